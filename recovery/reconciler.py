"""The reconciler: re-drives work from the ledger, not from the broker.

Run periodically by Celery beat on the ``reconcile`` queue. Each sweep looks for:
- actions published but never started (the broker lost the message) → re-send the stored signed
  message; the idempotency record makes a duplicate harmless;
- actions executing under an expired lease (the worker died) → re-send; the next holder finds the
  claim in progress and reconciles the downstream state before anything else;
- verifications that stalled (accepted operations to poll, unverified completions) → verify again;
- actions in recovery with no decision taken → recover again;
- run steps and compensated parents whose follow-up was lost between a commit and its hook;
- post-condition re-checks that are due (``recovery/recheck_sweep.py``) → send each to a worker.
Safe on several workers at once: rows are taken with ``FOR UPDATE SKIP LOCKED`` and pushed back
by ``next_check_at`` in the same statement, so two sweepers never re-drive the same action twice.

A sweep is one transaction for all it takes: the deadline expiry's closures, the delivery prune,
the five claims below (one flight) with their ``redriven`` events. Only once it committed are the
messages sent and the settled actions' follow-ups run (:func:`send`): a message is never sent
before the state that explains it is committed, and a sweep that dies before its commit took
nothing (its rows are found again). The reconcile task (:func:`sweep_once`) runs it once per period
for the whole fleet (``recovery/sweep_gate.py``), in the same transaction as the period's claim,
the heartbeat and the run's finish stamp: a sweep that finds nothing is one commit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import psycopg

from ledger import heartbeat, store
from proofline.errors import ProoflineError
from proofline.settings import Settings
from proofline.telemetry import tracing
from recovery import backlog, recheck_sweep, redrive_budget
from recovery.expiry import close_overdue_txn, prune_deliveries_txn
from recovery.settle import after_settle
from recovery.sweep_gate import SweepRun, Swept, run_once
from worker import faultpoints
from worker.dispatch import Dispatch

log = logging.getLogger(__name__)

#: The most rows one claim of a sweep takes.
SWEEP_LIMIT = 200
#: Counts a periodic sweep stamps about its budget, not about work it found.
BUDGET_COUNTS = ("redrive_budget", "drain_started", "redrives_waiting")

CLAIM_SQL = """
WITH due AS (
    SELECT a.action_id FROM actions a
    LEFT JOIN leases l ON l.action_id = a.action_id
    WHERE a.next_check_at < clock_timestamp() AND ({condition})
    ORDER BY a.next_check_at LIMIT %({limit})s
    FOR UPDATE OF a SKIP LOCKED
)
UPDATE actions a SET
    -- Exponential backoff per action: a long broker backlog looks like a lost message at first;
    -- re-driving it again and again would only add duplicates (harmless, but not free).
    -- Capped at eight times the base interval, so healed work is picked up again soon.
    next_check_at = clock_timestamp() + make_interval(secs => LEAST(8 * %(backoff)s,
        %(backoff)s * power(2, COALESCE((a.recovery_data->>'redrives')::int, 0)))),
    -- When it was last sent: what recovery/backlog.py compares with the oldest message waiting.
    recovery_data = jsonb_set(jsonb_set(a.recovery_data, '{{redrives}}',
        to_jsonb(COALESCE((a.recovery_data->>'redrives')::int, 0) + 1)), '{{sent_at}}', to_jsonb(clock_timestamp()))
FROM due WHERE a.action_id = due.action_id
RETURNING a.action_id, a.tenant, a.status, a.kind, a.envelope, a.key_id, a.signature, a.sealed_message
"""

#: (name, condition on a / l, what to do). Every claim takes up to ``limit`` rows; ``not_started``
#: takes up to ``redrive_limit`` (the fleet's re-drive budget, ``recovery/redrive_budget.py``).
SWEEPS = (
    # An action waiting out a failed precondition read has its retry on the way (worker/read_waits.py):
    # re-sent only once that retry is overdue, or a second chain of retries would read it again.
    ("not_started", "a.status = 'published' AND a.updated_at < clock_timestamp() - make_interval(secs => %(stale)s) "
                    "AND (l.action_id IS NULL OR l.released_at IS NOT NULL OR l.expires_at < clock_timestamp()) "
                    "AND COALESCE((a.recovery_data->'read_failures'->>'due')::timestamptz "
                    "< clock_timestamp() - make_interval(secs => %(stale)s), true) "
                    # Still behind other messages in its queue (recovery/backlog.py): late, not lost.
                    "AND a.action_id <> ALL(%(deferred)s::text[])",
     "execute"),
    ("lease_expired", "a.status = 'executing' AND l.released_at IS NULL AND l.expires_at < clock_timestamp()",
     "execute"),
    ("verification_stalled", "a.status = 'verifying' AND a.updated_at < clock_timestamp() - "
                             "make_interval(secs => %(verify_stale)s)", "verify"),
    ("recovery_pending", "a.status = 'recovery' AND a.updated_at < clock_timestamp() - make_interval(secs => %(stale)s)",
     "recover"),
    # Found from the few rows waiting on a follow-up (parents in recovery, pending next steps), not
    # by reading every settled action: that read grew with the ledger (1.4-2.1 s per sweep at
    # 100,000-200,000 settled actions, ops/CAPACITY.md).
    ("follow_up", "a.status IN ('closed', 'escalated', 'cancelled') AND a.updated_at > clock_timestamp() - "
                  "interval '1 day' AND a.updated_at < clock_timestamp() - make_interval(secs => %(stale)s) AND "
                  "a.action_id IN (SELECT c.action_id FROM actions p JOIN actions c ON c.parent_action_id = "
                  "p.action_id WHERE p.status = 'recovery' AND c.kind <> 'action' UNION ALL SELECT prev.action_id "
                  "FROM actions n JOIN actions prev ON prev.run_id = n.run_id AND prev.step = n.step - 1 "
                  "WHERE n.status = 'pending')", "settle"),
)

NOT_STARTED = next(condition for name, condition, _ in SWEEPS if name == "not_started")
#: The claim's row limit by sweep: the parameter it reads.
LIMIT_PARAM = {"not_started": "redrive_limit"}


@dataclass
class Taken:
    """What one sweep took in its transaction, for :func:`send` to act on once that committed."""

    counts: dict[str, int]
    #: Actions the deadline expiry closed: their follow-ups (a parent to settle, a run to release).
    expired: list[str] = field(default_factory=list)
    #: Claimed rows (with ``trace``, and for ``execute`` the ``message`` to send again) and what to do.
    redrives: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    #: Post-condition re-checks claimed now (``recovery/recheck_sweep.py``), to send once committed.
    rechecks: list[dict[str, Any]] = field(default_factory=list)


def take(cur: store.Cursor, actor: str, *, stale_seconds: float, verify_stale_seconds: float, limit: int = 200,
         deadline_grace_seconds: float = 60.0, delivery_retention_seconds: float = 2 * 3600.0,
         recheck_claim_seconds: float = 300.0, oldest: backlog.OldestWaiting | None = None,
         backlog_max_seconds: float = 900.0, shards: int = 1, redrive_limit: int | None = None,
         ready: backlog.ReadyCounts | None = None) -> Taken:
    """Everything a sweep writes, inside the caller's transaction; nothing is sent. With ``oldest``
    (the send time of the oldest message waiting in each queue), published actions that may still
    wait behind a backlog are left for a later sweep (``recovery/backlog.py``). ``redrive_limit``:
    at most this many ``not_started`` actions are re-sent (default: ``limit``); the rest stay due."""
    taken = Taken(counts={})
    taken.expired = close_overdue_txn(cur, actor, deadline_grace_seconds, limit)
    taken.counts["deadline_expired"] = len(taken.expired)
    taken.counts["deliveries_pruned"] = prune_deliveries_txn(cur, delivery_retention_seconds)
    params = {"limit": limit, "redrive_limit": limit if redrive_limit is None else min(limit, redrive_limit),
              "backoff": max(stale_seconds, 1.0), "stale": stale_seconds,
              "verify_stale": verify_stale_seconds, "deferred": [], "backlog_max": backlog_max_seconds}
    if oldest is not None:
        params["deferred"] = backlog.deferred_txn(cur, oldest, NOT_STARTED, params, shards, ready)
        taken.counts["redrives_deferred_backlog"] = len(params["deferred"])
    claimed = _claim_all(cur, params)
    for (name, _, action), rows in zip(SWEEPS, claimed, strict=True):
        for row in rows:
            row["trace"] = _trace_of(cur, row["action_id"])
            with tracing.resume(row["trace"], "proofline.redrive"):
                store.append_event_txn(cur, row["action_id"], "redriven", actor,
                                       {"reason": name, "status": row["status"], "by": "reconciler"})
                if action == "execute":
                    row["message"] = _message_or_refusal(cur, actor, row)
            taken.redrives.append((row, action))
        taken.counts[name] = len(rows)
    taken.rechecks, expired = recheck_sweep.take_txn(cur, actor, limit=limit, claim_seconds=recheck_claim_seconds)
    taken.counts["rechecks_claimed"], taken.counts["rechecks_expired"] = len(taken.rechecks), expired
    return taken


def _claim_all(cur: store.Cursor, params: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The five claims in one flight (pipeline mode; still the caller's transaction). Their
    conditions are disjoint by status, so no two claim the same row."""
    conn = cur.connection
    cursors = [conn.cursor() for _ in SWEEPS]
    with conn.pipeline():
        for each, (name, condition, _) in zip(cursors, SWEEPS, strict=True):
            each.execute(CLAIM_SQL.format(condition=condition, limit=LIMIT_PARAM.get(name, "limit")), params)
    return [list(each.fetchall()) for each in cursors]


def _message_or_refusal(cur: store.Cursor, actor: str, row: dict[str, Any]) -> dict[str, Any] | None:
    """The sealed original to send again, byte for byte what the controller signed (``envelope`` is
    redacted); None, with ``redrive_refused`` recorded, when it cannot be opened."""
    try:
        return store.signed_message_of(row)
    except ProoflineError as exc:
        store.append_event_txn(cur, row["action_id"], "redrive_refused", actor, exc.as_evidence())
        row["refused"] = exc.code
        return None


def send(conn: Any, dispatch: Dispatch, actor: str, taken: Taken) -> None:
    """What a committed sweep leaves to do: the expired actions' follow-ups, then the re-drives."""
    for action_id in taken.expired:
        after_settle(conn, actor, action_id, dispatch)
    for row, action in taken.redrives:
        with tracing.resume(row["trace"], "proofline.redrive"):
            _redrive(conn, dispatch, actor, row, action)
    recheck_sweep.send(dispatch, taken.rechecks)
    if any(n for name, n in taken.counts.items() if name not in BUDGET_COUNTS):
        log.info("reconciler re-drove work", extra={"event": "reconcile_sweep", **taken.counts})


def sweep(conn: Any, dispatch: Dispatch, actor: str, *, stale_seconds: float, verify_stale_seconds: float,
          limit: int = 200, deadline_grace_seconds: float = 60.0,
          delivery_retention_seconds: float = 2 * 3600.0, backlog_max_seconds: float = 900.0,
          shards: int = 1) -> dict[str, int]:
    """One sweep now, ungated (``proofline reconcile``): one transaction, then :func:`send`. It
    leaves a backlog alone as the periodic sweep does."""
    with store.transaction(conn) as cur:
        taken = take(cur, actor, stale_seconds=stale_seconds, verify_stale_seconds=verify_stale_seconds, limit=limit,
                     deadline_grace_seconds=deadline_grace_seconds,
                     delivery_retention_seconds=delivery_retention_seconds, oldest=dispatch.oldest_waiting,
                     ready=getattr(dispatch, "ready_counts", None),
                     backlog_max_seconds=backlog_max_seconds, shards=shards)
    send(conn, dispatch, actor, taken)
    return taken.counts


def sweep_once(conn: psycopg.Connection[dict[str, Any]], dispatch: Dispatch, settings: Settings) -> SweepRun | None:
    """The reconcile task's sweep: run if this process wins the period for the whole fleet, else
    None. It re-sends at most the fleet's re-drive budget of ``not_started`` actions
    (``recovery/redrive_budget.py``). The period's claim, :func:`take`, the heartbeat (what ``proofline doctor`` reads) and the
    run's finish stamp are one transaction; :func:`send` runs once it committed."""
    actor = settings.worker_id

    def body(run: SweepRun, cur: store.Cursor) -> Swept:
        faultpoints.hit("during_sweep")  # the run holds its period and the lock here, uncommitted
        budget = redrive_budget.measure_txn(cur, sweep=run.sweep, period_seconds=settings.reconcile_interval_seconds,
                                            share=settings.redrive_budget_share, floor=settings.redrive_budget_min,
                                            cap=SWEEP_LIMIT)
        taken = take(cur, actor, stale_seconds=settings.redrive_after_seconds,
                     verify_stale_seconds=settings.verify_stall_seconds,
                     deadline_grace_seconds=settings.deadline_grace_seconds,
                     # Longer than any deadline plus its grace: older counts can explain nothing still open.
                     delivery_retention_seconds=2 * settings.max_deadline_seconds + settings.deadline_grace_seconds,
                     recheck_claim_seconds=settings.recheck_claim_seconds, oldest=dispatch.oldest_waiting,
                     ready=getattr(dispatch, "ready_counts", None),
                     backlog_max_seconds=settings.redrive_backlog_max_seconds, shards=settings.tenant_shards,
                     limit=SWEEP_LIMIT, redrive_limit=budget.limit)
        if taken.counts["not_started"]:  # what bounded the re-sends (an idle sweep's counts stay all zero)
            taken.counts.update(redrive_budget=budget.limit, drain_started=budget.started,
                                redrives_waiting=budget.waiting)
        heartbeat.beat_txn(cur, actor, taken.counts)
        return Swept(taken.counts, then=lambda: send(conn, dispatch, actor, taken))

    return run_once(conn, "reconcile", settings.reconcile_interval_seconds, actor, body)


def _trace_of(cur: Any, action_id: str) -> dict[str, Any] | None:
    """The trace the action's events recorded last (only looked up while tracing is on)."""
    if not tracing.enabled():
        return None
    cur.execute("SELECT evidence->>'trace_id' AS trace_id, evidence->>'span_id' AS span_id FROM ledger_events "
                "WHERE action_id = %s AND evidence ? 'trace_id' ORDER BY seq DESC LIMIT 1", (action_id,))
    return cur.fetchone()


def _redrive(conn: Any, dispatch: Dispatch, actor: str, row: dict[str, Any], action: str) -> None:
    if action == "execute":
        if row.get("refused"):
            log.error("cannot re-drive: sealed message unreadable",
                      extra={"event": "redrive_refused", "action_id": row["action_id"], "reason_code": row["refused"]})
        elif row.get("message") is not None:
            queue = "compensate" if row["kind"] != "action" else "actions"
            dispatch.execute(row["message"], queue=queue)
    elif action == "verify":
        dispatch.verify(row["action_id"], row.get("tenant"))
    elif action == "recover":
        dispatch.recover(row["action_id"])
    else:
        after_settle(conn, actor, row["action_id"], dispatch)
