"""What one action settling means for others: the action it compensates, and its run.

Called right after the commit that settles an action. It is idempotent, and the reconciler calls
it again for anything a crash left between the commit and this hook.
"""

from __future__ import annotations

import logging
from typing import Any

from ledger import evidence, store
from ledger.redact import scrub_text
from ledger.states import ActionStatus, KillSwitchScope, Outcome
from proofline.envelope import Envelope
from proofline.errors import EvidenceMismatch, ParentRowMismatch, ParentSignatureInvalid
from proofline.keys import KeyRole, load_keyring
from proofline.settings import get_settings
from worker.dispatch import Dispatch
from worker.validate import authenticate_row

#: The ledger chain every security alert is also appended to, so operators read them in one place.
SECURITY_ALERTS = "alerts:security"

log = logging.getLogger(__name__)

DONE = (ActionStatus.closed, ActionStatus.escalated, ActionStatus.cancelled)


def after_settle(conn: Any, actor: str, action_id: str, dispatch: Dispatch, *, envelope: Envelope | None = None,
                 status: ActionStatus | None = None, outcome: Outcome | None = None) -> None:
    if envelope is None or status is None:
        with store.transaction(conn) as cur:
            row = store.get_action(cur, action_id)
        if row is None:
            return
        envelope, status, outcome = Envelope.model_validate(row.signed_envelope), row.status, row.outcome
    if status == ActionStatus.recovery:
        dispatch.recover(action_id)
        return
    if envelope.recovers and status in DONE:
        settle_parent(conn, actor, envelope, status, outcome, dispatch)
    if envelope.run_steps > 1 and status in DONE:
        from recovery.runs import on_step_settled

        on_step_settled(conn, actor, envelope, status, outcome, dispatch)


def settle_parent(conn: Any, actor: str, recovery_env: Envelope, status: ActionStatus, outcome: Outcome | None,
                  dispatch: Dispatch) -> None:
    """A recovery action has settled: close the action it recovers as compensated, or as
    compensation_failed (escalated, with automation contained for that tool and tenant)."""
    succeeded = status == ActionStatus.closed and outcome == Outcome.completed_verified
    with store.transaction(conn) as cur:
        own = store.get_action(cur, recovery_env.action_id)
        # Only a success needs the worker's signature: a failure escalates, which no forgery can abuse.
        verified = _authentic_recovery_row(cur, own, actor, succeeded) if own is not None else None
        if verified is None:
            return  # a recovery row the runtime did not write never settles anything
        parent_id = verified.recovers
        assert parent_id is not None
        parent = store.get_action(cur, parent_id)
        if parent is None or parent.status != ActionStatus.recovery:
            return  # already settled by an earlier call of this hook
        evidence: dict[str, Any] = {"recovery_action": recovery_env.action_id, "recovery_status": status.value,
                                    "recovery_outcome": outcome.value if outcome else None}
        if succeeded:
            final = ActionStatus.cancelled if parent.cancel_requested_at else ActionStatus.closed
            store.append_event_txn(cur, parent_id, "compensated", actor, evidence)
            store.transition_txn(cur, parent_id, [ActionStatus.recovery], final, outcome=Outcome.compensated,
                                 reason_code="compensated")
        else:
            value = f"{parent.tool}@{parent.tenant}"
            engaged = store.contain_txn(cur, parent_id, actor,
                                        f"compensation of {parent_id} failed ({recovery_env.action_id})")
            store.append_event_txn(cur, parent_id, "compensation_failed", actor,
                                   {**evidence, "contained": value, "kill_switch_set": engaged,
                                    "escalated_to": "manual intervention queue"})
            store.transition_txn(cur, parent_id, [ActionStatus.recovery], ActionStatus.escalated,
                                 outcome=Outcome.compensation_failed, reason_code="compensation_failed")
    log.info("recovery settled", extra={"action_id": parent_id, "event": "recovery_settled", "ok": succeeded})
    after_settle(conn, actor, parent_id, dispatch)


def _authentic_recovery_row(cur: Any, row: store.ActionRow, actor: str, succeeded: bool) -> Envelope | None:
    """The recovery action's verified envelope (its stored message signed by the recovery key, its
    columns matching; for a success, its closed verified state signed by a worker), or None after
    recording the refusal and raising the alert once."""
    settings = get_settings()
    try:
        ring = load_keyring(settings.keyring_file, settings.environment)
        envelope = authenticate_row(row, ring, KeyRole.recovery)
        if succeeded:
            if (row.status, row.outcome) != (ActionStatus.closed, Outcome.completed_verified):
                raise EvidenceMismatch(f"recovery action {row.action_id} is not closed verified", action_id=row.action_id,
                                       columns="status, outcome")
            evidence.check_txn(cur, row, ring, (ActionStatus.closed,))
        return envelope
    except (ParentSignatureInvalid, ParentRowMismatch) as exc:
        cur.execute("SELECT 1 FROM ledger_events WHERE action_id = %s AND event = 'settlement_refused'",
                    (row.action_id,))
        if cur.fetchone() is None:
            refusal = {**exc.as_evidence(), "reason": exc.code, "kind": row.kind,
                       "claimed_parent": row.parent_action_id}
            store.append_event_txn(cur, row.action_id, "settlement_refused", actor, refusal)
            store.append_event_txn(cur, SECURITY_ALERTS, "security_alert", actor,
                                   {"alert": "settlement_refused", "action_id": row.action_id, **refusal})
            log.error("security_alert settlement_refused: %s for recovery action %s (%s)", exc.code, row.action_id,
                      exc.detail, extra={"event": "settlement_refused", "action_id": row.action_id})
        return None


def set_kill_switch_txn(cur: Any, scope: KillSwitchScope, value: str, by: str, reason: str) -> bool:
    """Engage a kill switch (no-op when one is already active) and record it in its own chain."""
    reason = scrub_text(reason)
    cur.execute(
        """INSERT INTO kill_switches (scope, value, set_by, reason) VALUES (%s, %s, %s, %s)
           ON CONFLICT (scope, value) WHERE cleared_at IS NULL DO NOTHING RETURNING id""",
        (scope.value, value, by, reason),
    )
    engaged = cur.fetchone() is not None
    if engaged:
        store.append_event_txn(cur, f"killswitch:{scope.value}:{value}", "kill_switch_set", by,
                               {"scope": scope.value, "value": value, "reason": reason})
    return engaged
