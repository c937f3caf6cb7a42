"""The reconciler: re-drives work from the ledger, not from the broker.

Run periodically by Celery beat on the ``reconcile`` queue. Each sweep looks for:
- actions published but never started (the broker lost the message) → re-send the stored signed
  message; the idempotency record makes a duplicate harmless;
- actions executing under an expired lease (the worker died) → re-send; the next holder finds the
  claim in progress and reconciles the downstream state before anything else;
- verifications that stalled (accepted operations to poll, unverified completions) → verify again;
- actions in recovery with no decision taken → recover again;
- run steps and compensated parents whose follow-up was lost between a commit and its hook.
Safe on several workers at once: rows are taken with ``FOR UPDATE SKIP LOCKED`` and pushed back
by ``next_check_at`` in the same statement, so two sweepers never re-drive the same action twice.
The reconcile task runs a sweep once per period for the whole fleet (``recovery/sweep_gate.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from ledger import store
from proofline.errors import ProoflineError
from proofline.telemetry import tracing
from recovery.expiry import expire_overdue, prune_deliveries
from recovery.settle import after_settle
from worker.dispatch import Dispatch

log = logging.getLogger(__name__)

CLAIM_SQL = """
WITH due AS (
    SELECT a.action_id FROM actions a
    LEFT JOIN leases l ON l.action_id = a.action_id
    WHERE a.next_check_at < clock_timestamp() AND ({condition})
    ORDER BY a.next_check_at LIMIT %(limit)s
    FOR UPDATE OF a SKIP LOCKED
)
UPDATE actions a SET
    -- Exponential backoff per action: a long broker backlog looks like a lost message at first;
    -- re-driving it again and again would only add duplicates (harmless, but not free).
    -- Capped at eight times the base interval, so healed work is picked up again soon.
    next_check_at = clock_timestamp() + make_interval(secs => LEAST(8 * %(backoff)s,
        %(backoff)s * power(2, COALESCE((a.recovery_data->>'redrives')::int, 0)))),
    recovery_data = jsonb_set(a.recovery_data, '{{redrives}}',
        to_jsonb(COALESCE((a.recovery_data->>'redrives')::int, 0) + 1))
FROM due WHERE a.action_id = due.action_id
RETURNING a.action_id, a.tenant, a.status, a.kind, a.envelope, a.key_id, a.signature, a.sealed_message
"""

#: (name, condition on a / l, what to do)
SWEEPS = (
    ("not_started", "a.status = 'published' AND a.updated_at < clock_timestamp() - make_interval(secs => %(stale)s) "
                    "AND (l.action_id IS NULL OR l.released_at IS NOT NULL OR l.expires_at < clock_timestamp())",
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


def sweep(conn: Any, dispatch: Dispatch, actor: str, *, stale_seconds: float, verify_stale_seconds: float,
          limit: int = 200, deadline_grace_seconds: float = 60.0,
          delivery_retention_seconds: float = 2 * 3600.0) -> dict[str, int]:
    counts: dict[str, int] = {"deadline_expired": expire_overdue(conn, dispatch, actor, deadline_grace_seconds,
                                                                 limit),
                              "deliveries_pruned": prune_deliveries(conn, delivery_retention_seconds)}
    for name, condition, action in SWEEPS:
        with store.transaction(conn) as cur:
            cur.execute(CLAIM_SQL.format(condition=condition),
                        {"limit": limit, "backoff": max(stale_seconds, 1.0), "stale": stale_seconds,
                         "verify_stale": verify_stale_seconds})
            rows = list(cur.fetchall())
            for row in rows:
                row["trace"] = _trace_of(cur, row["action_id"])
                with tracing.resume(row["trace"], "proofline.redrive"):
                    store.append_event_txn(cur, row["action_id"], "redriven", actor,
                                           {"reason": name, "status": row["status"], "by": "reconciler"})
        for row in rows:
            with tracing.resume(row["trace"], "proofline.redrive"):
                _redrive(conn, dispatch, actor, row, action)
        counts[name] = len(rows)
    if any(counts.values()):
        log.info("reconciler re-drove work", extra={"event": "reconcile_sweep", **counts})
    return counts


def _trace_of(cur: Any, action_id: str) -> dict[str, Any] | None:
    """The trace the action's events recorded last (only looked up while tracing is on)."""
    if not tracing.enabled():
        return None
    cur.execute("SELECT evidence->>'trace_id' AS trace_id, evidence->>'span_id' AS span_id FROM ledger_events "
                "WHERE action_id = %s AND evidence ? 'trace_id' ORDER BY seq DESC LIMIT 1", (action_id,))
    return cur.fetchone()


def _redrive(conn: Any, dispatch: Dispatch, actor: str, row: dict[str, Any], action: str) -> None:
    if action == "execute":
        try:
            # The sealed original, byte for byte what the controller signed (envelope is redacted).
            message = store.signed_message_of(row)
        except ProoflineError as exc:
            with store.transaction(conn) as cur:
                store.append_event_txn(cur, row["action_id"], "redrive_refused", actor, exc.as_evidence())
            log.error("cannot re-drive: sealed message unreadable",
                      extra={"event": "redrive_refused", "action_id": row["action_id"], "reason_code": exc.code})
            return
        if message is not None:
            queue = "compensate" if row["kind"] != "action" else "actions"
            dispatch.execute(message, queue=queue)
    elif action == "verify":
        dispatch.verify(row["action_id"], row.get("tenant"))
    elif action == "recover":
        dispatch.recover(row["action_id"])
    else:
        after_settle(conn, actor, row["action_id"], dispatch)

