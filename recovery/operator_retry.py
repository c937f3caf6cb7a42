"""An operator's retry of an escalated action whose effect is proven absent.

Recovery retries by itself while the policy allows it (``recovery/recover.py``: the action goes back
to ``published`` and the controller's original signed message is sent again, same idempotency key).
When it gives up (retries exhausted, a manual policy) the action is escalated. An operator who has
fixed the cause may send it once more through that same path, and only when the ledger proves the
effect absent: the verification read showed no effect (or the call failed before any), and the
idempotency record is ``failed`` (or was never claimed), so the worker's own claim-first check
lets exactly one new call through. Everything the worker checks on any delivery (signature,
revocations, kill switches, the deadline, the call budget) it checks again.

Refusals carry a reason code (``proofline/errors/``, the ``RetryRefused`` family); the retry
itself is a ``manual_retry`` event on the action's chain, naming who and why, in the transaction
that moves the action from ``escalated`` to ``published``. The database allows that move to the
operator role only, and only from ``failed_before_side_effect`` (migration 0009).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ledger import store
from ledger.redact import scrub_text
from ledger.states import ActionStatus, IdempotencyStatus, RecoveryKind, VerificationFinding
from proofline.errors import (
    EffectNotProvenAbsent,
    NotFound,
    RetryBudgetExhausted,
    RetryExpired,
    RetryNotEscalated,
    RetryNotWanted,
    RetryRefused,
)
from proofline.keys import KeyRole, load_keyring
from proofline.settings import Settings
from recovery.policy import proven_absent
from worker.dispatch import Dispatch
from worker.validate import authenticate_row

#: Reason codes of escalations that are final for the work itself, whatever the effect.
NOT_WANTED = ("effect_absent_not_wanted", "run_step_failed", "run_aborted")


def retry_escalated(settings: Settings, conn: Any, dispatch: Dispatch, action_id: str, by: str,
                    why: str) -> dict[str, Any]:
    """Send an escalated action again (same envelope, same key) or raise a ``RetryRefused``."""
    why = scrub_text(why)
    with store.transaction(conn) as cur:
        cur.execute("SELECT 1 FROM actions WHERE action_id = %s FOR UPDATE", (action_id,))
        action = store.get_action(cur, action_id)
        if action is None:
            raise NotFound(f"no action {action_id}", action_id=action_id)
        if action.status != ActionStatus.escalated:
            raise RetryNotEscalated(f"{action_id} is {action.status.value}, not escalated", action_id=action_id)
        record = store.get_idempotency_txn(cur, action.idempotency_key)
        proof = _absence_proof(action, record)
        if action.cancel_requested_at is not None or action.reason_code in NOT_WANTED:
            raise RetryNotWanted(f"{action_id} must not run again (escalated as {action.reason_code}"
                                 f"{', cancellation requested' if action.cancel_requested_at else ''})",
                                 action_id=action_id)
        if action.signed_message is None:
            raise RetryRefused(f"{action_id} has no stored signed message to send again", action_id=action_id)
        # The same check recovery makes before deriving anything: the row is what the controller signed.
        role = KeyRole.controller if action.kind == "action" else KeyRole.recovery
        envelope = authenticate_row(action, load_keyring(settings.keyring_file, settings.environment), role)
        now = datetime.now(UTC)
        left = (envelope.deadline - now).total_seconds()
        if left <= envelope.timeout_seconds:
            raise RetryExpired(f"{action_id}: {max(left, 0):.0f} s left before its deadline, the call needs "
                               f"{envelope.timeout_seconds:g} s", action_id=action_id)
        if envelope.approval.expires_at <= now:
            raise RetryExpired(f"{action_id}: its approval expired at {envelope.approval.expires_at:%Y-%m-%d %H:%M:%S %Z}",
                               action_id=action_id)
        if record is not None and record.expired:
            raise RetryExpired(f"{action_id}: its idempotency record is past the replay window", action_id=action_id)
        calls = record.attempts if record is not None else 0
        if calls >= envelope.authority_budget.max_calls:
            raise RetryBudgetExhausted(f"{action_id}: every call the approval allows is made "
                                       f"({calls} of {envelope.authority_budget.max_calls})", action_id=action_id)
        evidence = {"by": by, "reason": why, "proof": proof, "calls_made": calls,
                    "calls_allowed": envelope.authority_budget.max_calls, "escalated_as": action.reason_code}
        store.transition_txn(cur, action_id, [ActionStatus.escalated], ActionStatus.published,
                             reason_code="operator_retry", recovery_kind=RecoveryKind.retry,
                             events=[("manual_retry", evidence)], actor=by)
    queue = "compensate" if envelope.recovers else "actions"
    task_id = dispatch.execute(action.signed_message, queue=queue)
    return {"action_id": action_id, "retried": True, "task_id": task_id, "calls_made": calls,
            "calls_allowed": envelope.authority_budget.max_calls, "proof": proof}


def _absence_proof(action: store.ActionRow, record: store.IdempotencyRecord | None) -> dict[str, Any]:
    """What proves the effect absent, or :class:`EffectNotProvenAbsent`."""
    finding = VerificationFinding(action.finding) if action.finding else None
    if not proven_absent(action.outcome, finding):
        raise EffectNotProvenAbsent(
            f"{action.action_id}: outcome {action.outcome.value if action.outcome else 'none'}, finding "
            f"{action.finding or 'none'}; resolve it by hand (proofline manual resolve) once the system of "
            "record is checked", action_id=action.action_id)
    if record is not None and record.status != IdempotencyStatus.failed:
        raise EffectNotProvenAbsent(f"{action.action_id}: its idempotency record is {record.status.value}, not "
                                    "failed", action_id=action.action_id)
    return {"outcome": action.outcome.value if action.outcome else None, "finding": action.finding,
            "idempotency_record": record.status.value if record is not None else "never claimed"}
