"""Actions that can no longer run: past their absolute deadline (plus a grace period) and still
``published``, or ``proposed`` with no approver having decided in time. Nothing may execute them any more (revalidation refuses a passed deadline), so
leaving them ``published`` would only hide why they never ran. The reconciler closes each with
``deadline_expired_unexecuted`` and the evidence of what was tried: re-drives, deliveries, the last
refusal or error of any delivery that claimed the action, and the last event of its own chain.

Both functions here write inside the caller's transaction (the reconciler's sweep is one). The
closed actions' follow-ups (``recovery/settle.py``) are the caller's to run once it committed.
"""

from __future__ import annotations

import logging
from typing import Any

from ledger import store
from ledger.states import ActionStatus, IdempotencyStatus, Outcome
from proofline.errors import DeadlineExpiredUnexecuted
from worker.read_waits import summary

log = logging.getLogger(__name__)

DUE_SQL = """
SELECT a.action_id, a.deadline, a.idempotency_key, a.recovery_data FROM actions a
LEFT JOIN leases l ON l.action_id = a.action_id
WHERE a.status IN ('published', 'proposed') AND a.deadline < clock_timestamp() - make_interval(secs => %(grace)s)
  AND (l.action_id IS NULL OR l.released_at IS NOT NULL OR l.expires_at < clock_timestamp())
ORDER BY a.deadline LIMIT %(limit)s
FOR UPDATE OF a SKIP LOCKED
"""

DELIVERIES_SQL = """
SELECT count(*) AS messages, COALESCE(sum(deliveries), 0) AS deliveries,
       bool_or(dead_lettered_at IS NOT NULL) AS dead_lettered,
       (array_agg(last_error ORDER BY last_at DESC) FILTER (WHERE last_error IS NOT NULL))[1] AS last_error
FROM message_deliveries WHERE action_id = %s
"""

# Refusals are on chains of their own (a forged message never writes into an action's chain); they
# quote the action id the message claimed.
LAST_REFUSAL_SQL = """
SELECT action_id AS chain, event, evidence->>'reason_code' AS reason_code, left(evidence->>'detail', 300) AS detail,
       at::text AS at FROM ledger_events
WHERE event IN ('envelope_refused', 'dead_lettered', 'delivery_abandoned')
  AND evidence->'claimed'->>'action_id' = %s
ORDER BY id DESC LIMIT 1
"""

LAST_EVENT_SQL = """
SELECT event, evidence->>'reason_code' AS reason_code, at::text AS at FROM ledger_events
WHERE action_id = %s ORDER BY seq DESC LIMIT 1
"""


def close_overdue_txn(cur: Any, actor: str, grace_seconds: float, limit: int = 200) -> list[str]:
    """Close every overdue unexecuted action (rows taken with ``SKIP LOCKED``); returns their ids,
    whose follow-ups the caller runs once its transaction committed."""
    closed: list[str] = []
    cur.execute(DUE_SQL, {"grace": grace_seconds, "limit": limit})
    for row in list(cur.fetchall()):
        evidence = _evidence(cur, row, grace_seconds)
        record = store.get_idempotency_txn(cur, row["idempotency_key"])
        # Its precondition read kept failing (worker/read_waits.py) and its last retry never came
        # back before the deadline: it ends as the read's failure, with the expiry as evidence.
        read_failed = last_read_failure(row["recovery_data"])
        if record is not None and record.status in (IdempotencyStatus.in_progress, IdempotencyStatus.unknown):
            # A claim without a known result: nothing is proven either way; an operator decides.
            status, outcome = ActionStatus.escalated, Outcome.unknown_outcome
        elif record is not None or read_failed:
            status, outcome = ActionStatus.closed, Outcome.failed_before_side_effect
        else:
            status, outcome = ActionStatus.closed, Outcome.not_started
        store.append_event_txn(cur, row["action_id"], DeadlineExpiredUnexecuted.code, actor, evidence)
        store.transition_txn(cur, row["action_id"], [ActionStatus.published, ActionStatus.proposed], status,
                             outcome=outcome,
                             reason_code=read_failed if record is None and read_failed else DeadlineExpiredUnexecuted.code)
        closed.append(row["action_id"])
        log.error("action expired unexecuted", extra={
            "event": "deadline_expired_unexecuted", "action_id": row["action_id"],
            "deliveries": evidence["deliveries"]["deliveries"], "redrives": evidence["redrives"],
            "last_refusal": (evidence["last_refusal"] or {}).get("reason_code")})
    return closed


def last_read_failure(recovery_data: dict[str, Any] | None) -> str | None:
    """The reason code of the precondition read failure counted last on the action, if any."""
    failures = ((recovery_data or {}).get("read_failures") or {}).get("causes") or {}
    rows = [v for v in failures.values() if isinstance(v, dict) and v.get("reason_code")]
    return str(max(rows, key=lambda v: str(v.get("last_at", "")))["reason_code"]) if rows else None


def _evidence(cur: Any, row: dict[str, Any], grace_seconds: float) -> dict[str, Any]:
    aid = row["action_id"]
    cur.execute(DELIVERIES_SQL, (aid,))
    deliveries = dict(cur.fetchone() or {})
    cur.execute(LAST_REFUSAL_SQL, (aid,))
    refusal = cur.fetchone()
    cur.execute(LAST_EVENT_SQL, (aid,))
    last = cur.fetchone()
    return {
        "reason_code": DeadlineExpiredUnexecuted.code,
        "detail": "the deadline passed while the action was still waiting to execute",
        "deadline": row["deadline"].isoformat(), "grace_seconds": grace_seconds,
        "redrives": int((row["recovery_data"] or {}).get("redrives", 0)),
        "deliveries": deliveries, "last_refusal": dict(refusal) if refusal else None,
        "last_event": dict(last) if last else None, "by": "reconciler",
        "read_failures": summary(((row["recovery_data"] or {}).get("read_failures") or {}).get("causes")),
    }


PRUNE_SQL = """
DELETE FROM message_deliveries WHERE message_key IN (
    SELECT message_key FROM message_deliveries
    WHERE unsettled = 0 AND last_at < clock_timestamp() - make_interval(secs => %(age)s)
    LIMIT %(limit)s)
"""


def prune_deliveries_txn(cur: Any, older_than_seconds: float, limit: int = 5000) -> int:
    """Forget settled delivery counts once no action they could explain can still be open (they
    are evidence for the expiry above, which happens within a deadline plus its grace)."""
    cur.execute(PRUNE_SQL, {"age": older_than_seconds, "limit": limit})
    return cur.rowcount
