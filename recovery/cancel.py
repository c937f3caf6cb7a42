"""Cancellation: record who asked and why, stop new work, revoke the queued task, signal an
in-flight call, and only call the action cancelled once its external state is known.

- Not started yet (published, or a pending run step): nothing was sent, so it is cancelled now.
- Executing: the worker's heartbeat sees the request and cancels the MCP call (the SDK sends
  ``notifications/cancelled``); the call is then an unknown outcome and verification reads the
  system of record. Effect absent → cancelled. Effect present (the server ignored the
  cancellation) → per the envelope's cancellation behaviour: compensated, or closed as done.
- Verifying: verification's disposition applies the same rules.
"""

from __future__ import annotations

from typing import Any

from ledger import store
from ledger.redact import scrub_text
from ledger.states import ActionStatus, Outcome

NOT_STARTED = (ActionStatus.published, ActionStatus.pending)


def cancel(conn: Any, dispatch: Any, action_id: str, who: str, why: str) -> dict[str, Any]:
    why = scrub_text(why)  # operator text is stored: no card number or credential pasted into it
    with store.transaction(conn) as cur:
        cur.execute(
            """UPDATE actions SET cancel_requested_at = clock_timestamp(), cancel_requested_by = %s,
                      cancel_reason = %s, updated_at = clock_timestamp()
               WHERE action_id = %s AND cancel_requested_at IS NULL
                 AND status NOT IN ('closed', 'cancelled')
               RETURNING status, task_id""",
            (who, why, action_id),
        )
        row = cur.fetchone()
        if row is None:
            current = store.get_action(cur, action_id)
            return {"action_id": action_id, "accepted": False,
                    "status": current.status.value if current else None}
        status = ActionStatus(row["status"])
        store.append_event_txn(cur, action_id, "cancel_requested", who, {"by": who, "reason": why,
                                                                         "status_at_request": status.value})
        if status in NOT_STARTED:
            store.append_event_txn(cur, action_id, "final_state", who, {
                "status": "cancelled", "outcome": Outcome.not_started.value,
                "how_known": "no worker had claimed it: nothing was sent"})
            store.transition_txn(cur, action_id, NOT_STARTED, ActionStatus.cancelled, outcome=Outcome.not_started,
                                 reason_code="cancelled")
    if row["task_id"]:
        dispatch.revoke(row["task_id"])  # best effort: a late delivery finds the action settled anyway
    if status in NOT_STARTED:
        from recovery.settle import after_settle

        after_settle(conn, who, action_id, dispatch)
    return {"action_id": action_id, "accepted": True, "status_at_request": status.value,
            "disposition": "cancelled" if status in NOT_STARTED else "awaiting external state"}
