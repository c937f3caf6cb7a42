"""Fleet-wide sweeps: a periodic sweep runs once per period across all nodes, not once per node.

Every node may run its own Celery beat, so with N beats N copies of the reconcile task arrive each
period. A run is one transaction, and its first statement does two things:

- takes a transaction-level advisory lock named after the sweep (``pg_try_advisory_xact_lock``,
  never waiting): at most one run of a sweep at a time, fleet-wide. Postgres releases it when the
  transaction ends, committed or rolled back, and with the session of a holder that dies (or
  freezes until Postgres ends its session for idling in a transaction): nothing ever unlocks it;
- claims the period: ``INSERT INTO sweep_runs (sweep, slot, holder) ON CONFLICT DO NOTHING``,
  where ``slot`` is the database clock divided by the period. ``(sweep, slot)`` is unique, so a
  copy arriving later in the same period finds the slot taken and skips (its transaction wrote
  nothing);
- unless the previous period's run finished less than half a period ago (:data:`REST_SHARE`):
  then this copy skips (a later one in the same period may run it). Periods are slots of the clock, not gaps between runs, so a run
  that took most of its period (a sweep re-sending hundreds of messages) used to be followed at
  once by the next one, as soon as the slot turned: sweeps back to back.

The body runs in the same transaction, behind a savepoint, and the run is stamped ``finished_at``
with the body's counts (old runs pruned) before the one ``COMMIT``: a sweep that finds nothing
costs one transaction. What the body leaves for after the commit (sending messages) runs only once
the commit succeeded, so nothing is ever sent before the state that explains it is committed.

What a run leaves in ``sweep_runs``:

- committed: its row, finished, with its counts;
- a body that raised: its work rolled back to the savepoint, the row stamped ``{"error": <type>}``
  and committed (the period is used; the next period runs as usual), then the error re-raised;
- the work after the commit raised: the committed row keeps its counts and gains
  ``"error_after_commit": <type>`` in a short transaction of its own;
- a holder that died or froze mid-run: no row. Its claim rolled back with everything it had done,
  the rows it had taken are as they were, and the next period's run takes them. A run in progress
  is not visible in ``sweep_runs`` either (its row is not committed yet): its session holds the
  sweep's advisory lock (:data:`HOLDER_SQL`).

The run id is the run's fencing token (a sequence: later runs have larger ids; a run that rolled
back used its id, so ids have gaps).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from ledger import store
from proofline.errors import ProoflineError, SweepRunLost

log = logging.getLogger(__name__)

#: How long finished runs are kept (an operator reads who swept, and when).
KEEP_SECONDS = 24 * 3600.0

CLAIM_SQL = """
WITH lock AS MATERIALIZED (SELECT pg_try_advisory_xact_lock(hashtextextended(%(lock)s, 0)) AS got),
now_slot AS MATERIALIZED (SELECT floor(extract(epoch FROM clock_timestamp()) / %(period)s)::bigint AS slot),
-- The previous period's run finished too recently: this period is skipped (no run back to back).
rested AS MATERIALIZED (
    SELECT NOT EXISTS (SELECT 1 FROM sweep_runs r, now_slot
                       WHERE r.sweep = %(sweep)s AND r.slot = now_slot.slot - 1
                         AND r.finished_at > clock_timestamp() - make_interval(secs => %(gap)s)) AS ok
),
claimed AS (
    INSERT INTO sweep_runs (sweep, slot, holder)
    SELECT %(sweep)s, now_slot.slot, %(holder)s
    FROM lock, now_slot, rested WHERE lock.got AND rested.ok
    ON CONFLICT (sweep, slot) DO NOTHING
    RETURNING run_id, slot
)
SELECT lock.got, rested.ok AS rested, claimed.run_id, claimed.slot FROM lock CROSS JOIN rested LEFT JOIN claimed ON true
"""

#: A run starts no sooner than this share of a period after the previous period's run finished:
#: a run that took most of its period is followed by a pause, not by the next run at once.
REST_SHARE = 0.5

FINISH_SQL = """
WITH finished AS (
    UPDATE sweep_runs SET finished_at = clock_timestamp(), counts = %(counts)s
    WHERE run_id = %(run_id)s AND finished_at IS NULL
    RETURNING run_id
), pruned AS (
    DELETE FROM sweep_runs WHERE sweep = %(sweep)s
        AND started_at < clock_timestamp() - make_interval(secs => %(keep)s)
)
SELECT count(*) AS finished FROM finished
"""

AFTER_COMMIT_FAILED_SQL = "UPDATE sweep_runs SET counts = counts || %s WHERE run_id = %s"

#: The session running a sweep now, if any (what ``sweep_runs`` cannot show before its commit):
#: the holder of the sweep's advisory lock. Reading other sessions' state needs ``pg_read_all_stats``.
HOLDER_SQL = """
SELECT a.pid, a.application_name, a.state, a.xact_start FROM pg_locks l JOIN pg_stat_activity a USING (pid)
WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.database = a.datid
  AND a.datname = current_database()
  AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended(%s, 0)
"""


def lock_name(sweep: str) -> str:
    return f"proofline:sweep:{sweep}"


@dataclass(frozen=True)
class SweepRun:
    """A run that claimed its period: ``run_id`` is its fencing token, ``slot`` its period."""

    sweep: str
    run_id: int
    slot: int
    counts: dict[str, Any]


@dataclass(frozen=True)
class Swept:
    """What a run's body did in the run's transaction: ``counts`` (stamped on the run in that same
    transaction) and ``then``, what is left to do once the transaction committed (or None)."""

    counts: dict[str, Any]
    then: Callable[[], None] | None = None


#: A run's body: it runs inside the run's transaction, on the cursor it is given.
Body = Callable[[SweepRun, store.Cursor], Swept]


def run_once(conn: psycopg.Connection[dict[str, Any]], sweep: str, period_seconds: float, holder: str,
             body: Body) -> SweepRun | None:
    """Run ``body`` if this process wins the sweep's lock and its current period; else None.

    One transaction: the claim, the body (behind a savepoint) and the finish stamp; then, committed,
    the body's ``then``. A body that raises leaves its run committed with the error's type, and the
    error is re-raised; so is an error of ``then``, after it is noted on the run."""
    failure: BaseException | None = None
    with store.transaction(conn) as cur:
        claimed = _claim(cur, sweep, period_seconds, holder)
        if claimed is None:
            return None  # nothing was written: the transaction commits empty, the lock goes with it
        run = SweepRun(sweep=sweep, run_id=claimed[0], slot=claimed[1], counts={})
        try:
            with store.transaction(conn) as inner:  # a savepoint: a failing body rolls back to here
                swept = body(run, inner)
        except BaseException as exc:
            if conn.closed or conn.broken:
                raise  # the session is gone, and the whole run with it (claim included)
            failure, swept = exc, Swept({"error": type(exc).__name__})
        _finish(cur, run, swept.counts)
    if failure is not None:
        raise failure
    done = SweepRun(sweep=sweep, run_id=run.run_id, slot=run.slot, counts=swept.counts)
    if swept.then is not None:
        try:
            swept.then()
        except BaseException as exc:
            _note_after_commit_failure(conn, done, exc)
            raise
    return done


def _claim(cur: store.Cursor, sweep: str, period_seconds: float, holder: str) -> tuple[int, int] | None:
    """Take the sweep's lock and its current period: ``(run_id, slot)``; or None when another run
    holds the lock or this period's run already happened."""
    period = max(period_seconds, 0.001)
    cur.execute(CLAIM_SQL, {"lock": lock_name(sweep), "sweep": sweep, "period": period, "holder": holder,
                            "gap": REST_SHARE * period})
    row = cur.fetchone()
    assert row is not None
    if row["run_id"] is None:
        reason = ("another run holds it" if not row["got"] else
                  "the previous run finished moments ago" if not row["rested"] else "period already ran")
        log.debug("sweep skipped", extra={"event": "sweep_skipped", "sweep": sweep, "reason": reason})
        return None
    return row["run_id"], row["slot"]


def _finish(cur: store.Cursor, run: SweepRun, counts: dict[str, Any]) -> None:
    """Stamp the run finished with ``counts`` and prune old runs. Raises :class:`SweepRunLost` when
    the run was not open any more (never silent)."""
    cur.execute(FINISH_SQL, {"counts": Jsonb(counts), "run_id": run.run_id, "sweep": run.sweep, "keep": KEEP_SECONDS})
    row = cur.fetchone()
    if row is None or row["finished"] != 1:
        raise SweepRunLost(f"sweep run {run.run_id} of {run.sweep} was not open when it finished", run_id=run.run_id)


def _note_after_commit_failure(conn: psycopg.Connection[dict[str, Any]], run: SweepRun, exc: BaseException) -> None:
    """Add ``error_after_commit`` to a committed run whose follow-through raised (a transaction of
    its own: the failure case only)."""
    if conn.closed or conn.broken:
        log.warning("failed sweep run not stamped: the session is gone",
                    extra={"event": "sweep_unstamped", "sweep": run.sweep, "error": type(exc).__name__})
        return
    try:
        with store.transaction(conn) as cur:
            cur.execute(AFTER_COMMIT_FAILED_SQL, (Jsonb({"error_after_commit": type(exc).__name__}), run.run_id))
    except (psycopg.Error, ProoflineError) as again:
        log.warning("failed sweep run not stamped", extra={"event": "sweep_unstamped", "sweep": run.sweep,
                                                           "error": type(again).__name__})
