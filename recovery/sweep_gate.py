"""Fleet-wide sweeps: a periodic sweep runs once per period across all nodes, not once per node.

Every node may run its own Celery beat, so with N beats N copies of the reconcile task arrive each
period. Before sweeping, a run does two things in one statement:

- takes a session advisory lock named after the sweep (``pg_try_advisory_lock``, never waiting):
  at most one run of a sweep at a time, fleet-wide. It lives on the sweeping process's own
  connection, so a holder that dies (or freezes until Postgres ends its idle session) lets the
  next period's run go ahead without anyone cleaning up;
- claims the period: ``INSERT INTO sweep_runs (sweep, slot, holder) ON CONFLICT DO NOTHING``,
  where ``slot`` is the database clock divided by the period. ``(sweep, slot)`` is unique, so a
  second copy arriving in the same period finds the slot taken and skips.

The run id is the run's fencing token (a sequence: later runs have larger ids). When the body
ends, the run is stamped ``finished_at`` with its counts (or its error) and the lock is released in
the same round trip. A run left unfinished is one whose holder died mid-sweep; the rows it had
taken stay safe (the reconciler takes rows with ``SKIP LOCKED`` and pushes them back in the same
statement), and the next period's run starts afresh. Old runs are pruned when a run finishes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from ledger import store
from proofline.errors import SweepRunLost

log = logging.getLogger(__name__)

#: How long finished and abandoned runs are kept (an operator reads who swept, and when).
KEEP_SECONDS = 24 * 3600.0

CLAIM_SQL = """
WITH lock AS MATERIALIZED (SELECT pg_try_advisory_lock(hashtextextended(%(lock)s, 0)) AS got),
claimed AS (
    INSERT INTO sweep_runs (sweep, slot, holder)
    SELECT %(sweep)s, floor(extract(epoch FROM clock_timestamp()) / %(period)s)::bigint, %(holder)s
    FROM lock WHERE lock.got
    ON CONFLICT (sweep, slot) DO NOTHING
    RETURNING run_id, slot
)
SELECT lock.got, claimed.run_id, claimed.slot FROM lock LEFT JOIN claimed ON true
"""

FINISH_SQL = """
WITH finished AS (
    UPDATE sweep_runs SET finished_at = clock_timestamp(), counts = %(counts)s
    WHERE run_id = %(run_id)s AND finished_at IS NULL
    RETURNING run_id
), pruned AS (
    DELETE FROM sweep_runs WHERE sweep = %(sweep)s
        AND started_at < clock_timestamp() - make_interval(secs => %(keep)s)
)
SELECT (SELECT count(*) FROM finished) AS finished, pg_advisory_unlock(hashtextextended(%(lock)s, 0)) AS unlocked
"""

UNLOCK_SQL = "SELECT pg_advisory_unlock(hashtextextended(%s, 0))"


def lock_name(sweep: str) -> str:
    return f"proofline:sweep:{sweep}"


@dataclass(frozen=True)
class SweepRun:
    """A run that claimed its period: ``run_id`` is its fencing token, ``slot`` its period."""

    sweep: str
    run_id: int
    slot: int
    counts: dict[str, Any]


def claim(conn: psycopg.Connection[dict[str, Any]], sweep: str, period_seconds: float,
          holder: str) -> tuple[int, int] | None:
    """Take the sweep's lock and its current period: ``(run_id, slot)``, holding the lock; or None,
    holding nothing, when another run holds the lock or this period's run already happened."""
    name = lock_name(sweep)
    with store.transaction(conn) as cur:
        cur.execute(CLAIM_SQL, {"lock": name, "sweep": sweep, "period": max(period_seconds, 0.001), "holder": holder})
        row = cur.fetchone()
    assert row is not None
    if row["got"] and row["run_id"] is None:
        # This period's run already happened (another node's beat came first): give the lock back.
        with conn.cursor() as cur:
            cur.execute(UNLOCK_SQL, (name,))
        return None
    if not row["got"]:
        return None
    return row["run_id"], row["slot"]


def finish(conn: psycopg.Connection[dict[str, Any]], sweep: str, run_id: int, counts: dict[str, Any]) -> None:
    """Stamp the run finished and release the lock (one round trip). Raises :class:`SweepRunLost`
    when the run was not open any more (pruned, or finished by someone else: never silent)."""
    with store.transaction(conn) as cur:
        cur.execute(FINISH_SQL, {"counts": Jsonb(counts), "run_id": run_id, "sweep": sweep, "keep": KEEP_SECONDS,
                                 "lock": lock_name(sweep)})
        row = cur.fetchone()
    assert row is not None
    if row["finished"] != 1:
        raise SweepRunLost(f"sweep run {run_id} of {sweep} was not open when it finished", run_id=run_id)


def run_once(conn: psycopg.Connection[dict[str, Any]], sweep: str, period_seconds: float, holder: str,
             body: Callable[[SweepRun], dict[str, Any]]) -> SweepRun | None:
    """Run ``body`` if this process wins the sweep's lock and its current period; else None.

    The lock is released whatever happens (with the finish stamp, or alone when the body raised;
    a broken connection released it already). A body that raises leaves its run recorded with the
    error's type and re-raises."""
    claimed = claim(conn, sweep, period_seconds, holder)
    if claimed is None:
        log.debug("sweep skipped: another run holds it or ran this period", extra={"event": "sweep_skipped",
                                                                                   "sweep": sweep})
        return None
    run = SweepRun(sweep=sweep, run_id=claimed[0], slot=claimed[1], counts={})
    try:
        counts = body(run)
    except BaseException as exc:
        _finish_failed(conn, run, exc)
        raise
    finish(conn, sweep, run.run_id, counts)
    return SweepRun(sweep=sweep, run_id=run.run_id, slot=run.slot, counts=counts)


def _finish_failed(conn: psycopg.Connection[dict[str, Any]], run: SweepRun, exc: BaseException) -> None:
    if conn.closed or conn.broken:
        return  # the session is gone, and its advisory lock with it; the run stays unfinished
    try:
        finish(conn, run.sweep, run.run_id, {"error": type(exc).__name__})
    except (psycopg.Error, SweepRunLost) as again:
        log.warning("failed sweep run not stamped", extra={"event": "sweep_unstamped", "sweep": run.sweep,
                                                           "error": type(again).__name__})
        try:
            with conn.cursor() as cur:
                cur.execute(UNLOCK_SQL, (lock_name(run.sweep),))
        except psycopg.Error:
            pass  # a broken session holds no lock
