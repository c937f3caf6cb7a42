"""The recovery task: decide (``recovery/policy.py``), record the decision with its inputs, act.

Retry re-drives the controller's original signed message (same key); compensation, rollback and
forward recovery publish a separately governed recovery action onto the ``compensate`` queue;
containment engages a kill switch for the tool and tenant; manual intervention escalates to the
operator queue. Nothing here calls a write tool directly.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from ledger import store
from ledger.states import ActionStatus, KillSwitchScope, RecoveryKind, VerificationFinding
from proofline.controller import signed_message
from proofline.envelope import Envelope
from proofline.errors import ProoflineError
from recovery.derive import derive_envelope
from recovery.policy import Decision, Facts, decide
from recovery.settle import after_settle, set_kill_switch_txn
from worker.dispatch import Dispatch
from worker.runtime import Runtime

log = logging.getLogger(__name__)

WORKFLOW = {RecoveryKind.compensation: "compensation", RecoveryKind.native_rollback: "rollback",
            RecoveryKind.forward_recovery: "forward"}


def facts_for(action: store.ActionRow, envelope: Envelope, record: store.IdempotencyRecord | None) -> Facts:
    return Facts(
        outcome=action.outcome,
        finding=VerificationFinding(action.finding) if action.finding else None,
        attempts=record.attempts if record else 0,
        max_attempts=min(envelope.retry_policy.max_attempts, envelope.authority_budget.max_calls),
        seconds_left=(envelope.deadline - datetime.now(UTC)).total_seconds(),
        retry_cost_seconds=envelope.retry_policy.backoff_seconds + envelope.timeout_seconds,
        is_compensation=envelope.recovers is not None,
        irreversible=envelope.irreversible,
        cancel_requested=action.cancel_requested_at is not None,
        run_failed=action.reason_code == "run_step_failed",
    )


def recover(rt: Runtime, action_id: str, dispatch: Dispatch) -> dict[str, Any]:
    actor = rt.settings.worker_id
    backoff = 0.0
    with store.transaction(rt.conn) as cur:
        cur.execute("SELECT 1 FROM actions WHERE action_id = %s FOR UPDATE", (action_id,))
        action = store.get_action(cur, action_id)
        if action is None or action.status != ActionStatus.recovery:
            return {"status": "skipped", "action_id": action_id}
        envelope = Envelope.model_validate(action.envelope)
        contract = rt.contract(envelope.action_type)
        if action.recovery_kind in {k.value for k in WORKFLOW}:
            # Decided already. Publish the recovery action if a crash lost it; otherwise wait for it.
            cur.execute("SELECT 1 FROM actions WHERE parent_action_id = %s", (action_id,))
            if cur.fetchone() is not None:
                return {"status": "awaiting_recovery_action", "action_id": action_id}
            lost = Decision(RecoveryKind(action.recovery_kind), action.reason_code or "recovery")
        else:
            lost = None
            # Decided under the row lock that read the facts: two recover tasks never both decide.
            decision, backoff = _decide_txn(cur, rt, action, envelope, contract, actor)
    if lost is not None:
        return _start_recovery_action(rt, action, envelope, contract, lost, dispatch)
    if decision.kind == RecoveryKind.retry:
        queue = "compensate" if envelope.recovers else "actions"
        dispatch.execute(action.signed_message, queue=queue, countdown=backoff)
    elif decision.kind in WORKFLOW:
        return _start_recovery_action(rt, action, envelope, contract, decision, dispatch)
    else:
        after_settle(rt.conn, actor, action_id, dispatch)
    return {"status": decision.kind.value, "action_id": action_id, "reason": decision.reason}


def _decide_txn(cur: Any, rt: Runtime, action: store.ActionRow, envelope: Envelope, contract: Any,
                actor: str) -> tuple[Decision, float]:
    """Decide, record the decision with its inputs, contain if told to, and move the action.
    Returns the decision and, for a retry, its backoff."""
    action_id = action.action_id
    record = store.get_idempotency_txn(cur, envelope.idempotency_key)
    facts = facts_for(action, envelope, record)
    decision = decide(facts, contract.recovery)
    # Exponential backoff between attempts of the same intent (same key), capped by the time left.
    backoff = min(envelope.retry_policy.backoff_seconds * 2 ** max(facts.attempts - 1, 0),
                  max(facts.seconds_left - facts.retry_cost_seconds, 0.0))
    store.append_event_txn(cur, action_id, "recovery_decided", actor,
                           {"decision": decision.kind.value, "reason": decision.reason, "contain": decision.contain,
                            "backoff_seconds": backoff if decision.kind == RecoveryKind.retry else None,
                            "facts": facts.as_evidence(), "policy": contract.recovery.model_dump(mode="json",
                                                                                                 exclude_none=True)})
    if decision.contain:
        value = f"{action.tool}@{action.tenant}"
        set_kill_switch_txn(cur, KillSwitchScope.tool_tenant, value, actor, f"containment for {action_id}: "
                            f"{decision.reason}")
        store.append_event_txn(cur, action_id, "contained", actor, {"kill_switch": f"tool_tenant:{value}"})
    if decision.kind == RecoveryKind.retry:
        if action.signed_message is None:
            decision = Decision(RecoveryKind.manual_intervention, "no_signed_message_to_retry")
        else:
            store.transition_txn(cur, action_id, [ActionStatus.recovery], ActionStatus.published,
                                 recovery_kind=RecoveryKind.retry)
    if decision.kind in (RecoveryKind.manual_intervention, RecoveryKind.containment):
        store.append_event_txn(cur, action_id, "escalated", actor,
                               {"reason_code": decision.reason, "queue": "manual intervention"})
        store.transition_txn(cur, action_id, [ActionStatus.recovery], ActionStatus.escalated,
                             reason_code=decision.reason, recovery_kind=decision.kind)
    elif decision.kind in WORKFLOW:
        store.transition_txn(cur, action_id, [ActionStatus.recovery], ActionStatus.recovery,
                             recovery_kind=decision.kind, reason_code=decision.reason)
    return decision, backoff


def _start_recovery_action(rt: Runtime, action: store.ActionRow, envelope: Envelope, contract: Any,
                           decision: Decision, dispatch: Dispatch) -> dict[str, Any]:
    from proofline.controller import publish_message, validate_for_publish

    kind = WORKFLOW[decision.kind]
    spec = getattr(contract.recovery, kind)
    actor = rt.settings.worker_id
    try:
        derived, _ = derive_envelope(rt, action, envelope, spec, kind)
        message = signed_message(rt.settings, derived)
        # The same validation the worker runs (size, schema, hashes, contract): a recovery action it
        # would refuse is never recorded as published.
        validate_for_publish(rt.settings, message)
    except ProoflineError as exc:
        # The recorded recovery data cannot build the recovery action: an operator must.
        with store.transaction(rt.conn) as cur:
            store.append_event_txn(cur, action.action_id, "recovery_action_underivable", actor, exc.as_evidence())
            store.transition_txn(cur, action.action_id, [ActionStatus.recovery], ActionStatus.escalated,
                                 reason_code="recovery_action_underivable",
                                 recovery_kind=RecoveryKind.manual_intervention)
        return {"status": "escalated", "action_id": action.action_id}
    published = publish_message(rt.conn, dispatch, message, derived, queue="compensate", kind=kind,
                                parent_action_id=action.action_id, actor=actor, settings=rt.settings)
    with store.transaction(rt.conn) as cur:
        store.append_event_txn(cur, action.action_id, "recovery_action_published", actor,
                               {"recovery_action": derived.action_id, "kind": kind, "action_type": derived.action_type,
                                "target": derived.target.model_dump(mode="json"), "arguments": derived.arguments,
                                "idempotency_key": derived.idempotency_key, "already_published": published["republished"]},
                               envelope.evidence.redact_fields)
    return {"status": decision.kind.value, "action_id": action.action_id, "recovery_action": derived.action_id}
