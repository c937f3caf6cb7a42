"""The recovery task: decide (``recovery/policy.py``), record the decision with its inputs, act.

Retry re-drives the controller's original signed message (same key); compensation, rollback and
forward recovery publish a separately governed recovery action onto the ``compensate`` queue;
containment engages a kill switch for the tool and tenant; manual intervention escalates to the
operator queue. Nothing here calls a write tool directly.

Before any of that, the action's stored signed message is verified against the keyring and the
row's columns are compared with it (``worker.validate.authenticate_row``), and its state columns with
the evidence statement a worker signed for them (``ledger.evidence.check_txn``): a row the runtime did
not write is refused (``recovery_refused``), escalated and alerted on, and nothing is derived or signed.
Derived envelopes are signed with the recovery key, which only recovery processes hold.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from ledger import evidence, store
from ledger.publication import publish_message, validate_for_publish
from ledger.redact import current_redactor, for_envelope
from ledger.states import ActionStatus, RecoveryKind, VerificationFinding
from proofline.envelope import Envelope
from proofline.errors import ParentRowMismatch, ParentSignatureInvalid, ProoflineError
from proofline.keys import KeyRole, load_keyring
from proofline.telemetry import context as telemetry_context
from proofline.telemetry import tracing
from recovery.derive import derive_envelope, recovery_signed_message
from recovery.policy import Decision, Facts, decide
from recovery.settle import SECURITY_ALERTS, after_settle
from worker.dispatch import Dispatch
from worker.runtime import Runtime
from worker.validate import authenticate_row

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


def signed_statuses(action: store.ActionRow, envelope: Envelope) -> tuple[ActionStatus, ...]:
    """The signed statuses that vouch for a row in recovery: a worker moved it there, or it is a
    verified step of a multi-step run that the run coordinator sent back to be undone."""
    if action.reason_code == "run_step_failed" and envelope.run_steps > 1 and envelope.recovers is None:
        return ActionStatus.recovery, ActionStatus.closed
    return (ActionStatus.recovery,)


def recover(rt: Runtime, action_id: str, dispatch: Dispatch) -> dict[str, Any]:
    actor = rt.settings.worker_id
    backoff = 0.0
    with store.transaction(rt.conn) as cur:
        cur.execute("SELECT 1 FROM actions WHERE action_id = %s FOR UPDATE", (action_id,))
        action = store.get_action(cur, action_id)
        if action is None or action.status != ActionStatus.recovery:
            return {"status": "skipped", "action_id": action_id}
        try:
            # Every fact below comes from the verified signed message, never from the row's copy, and
            # from state columns equal to what a worker signed (EvidenceUnsigned/-Mismatch are among these).
            ring = load_keyring(rt.settings.keyring_file, rt.settings.environment)
            envelope = authenticate_row(action, ring, KeyRole.controller if action.kind == "action" else KeyRole.recovery)
            evidence.check_txn(cur, action, ring, signed_statuses(action, envelope))
        except (ParentSignatureInvalid, ParentRowMismatch) as exc:
            return _refuse_txn(cur, action, exc, actor)
        contract = rt.contract(envelope.action_type)
        current_redactor.set(for_envelope(action.signed_envelope, contract.sensitive_fields))
        telemetry_context.bind(action_id, run_id=action.run_id, tenant=action.tenant, action_type=action.action_type,
                               irreversible=envelope.irreversible, stage="recover")
        if action.recovery_kind in {k.value for k in WORKFLOW}:
            # Decided already. Publish the recovery action if a crash lost it; otherwise wait for it.
            cur.execute("SELECT 1 FROM actions WHERE parent_action_id = %s", (action_id,))
            if cur.fetchone() is not None:
                return {"status": "awaiting_recovery_action", "action_id": action_id}
            lost = Decision(RecoveryKind(action.recovery_kind), action.reason_code or "recovery")
        else:
            lost = None
            # Decided under the row lock that read the facts: two recover tasks never both decide.
            with tracing.span("proofline.recovery_decision", **{"proofline.action_type": action.action_type}) as sp:
                decision, backoff = _decide_txn(cur, rt, action, envelope, contract, actor)
                tracing.annotate(sp, **{"proofline.recovery_kind": decision.kind.value})
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


def _refuse_txn(cur: Any, action: store.ActionRow, exc: ProoflineError, actor: str) -> dict[str, Any]:
    """A row recovery cannot trust: record the refusal, escalate it, raise the alert. Nothing is
    derived, signed, sent or called."""
    evidence = {**exc.as_evidence(), "reason": exc.code, "kind": action.kind, "claimed_tenant": action.tenant,
                "claimed_action_type": action.action_type, "key_id": action.key_id}
    store.append_event_txn(cur, action.action_id, "recovery_refused", actor, evidence)
    store.append_event_txn(cur, action.action_id, "escalated", actor,
                           {"reason_code": exc.code, "queue": "manual intervention"})
    store.transition_txn(cur, action.action_id, [ActionStatus.recovery], ActionStatus.escalated,
                         reason_code=exc.code, recovery_kind=RecoveryKind.manual_intervention)
    store.append_event_txn(cur, SECURITY_ALERTS, "security_alert", actor,
                           {"alert": "recovery_refused", "action_id": action.action_id, **evidence})
    log.error("security_alert recovery_refused: %s for action %s (%s)", exc.code, action.action_id, exc.detail,
              extra={"event": "recovery_refused", "action_id": action.action_id, "reason_code": exc.code})
    return {"status": "refused", "action_id": action.action_id, "reason": exc.code}


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
        value = f"{envelope.server.name}:{action.tool}@{action.tenant}"
        store.contain_txn(cur, action_id, actor, f"containment for {action_id}: {decision.reason}")
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
    with tracing.span("proofline.compensation", **{"proofline.action_type": action.action_type,
                                                    "proofline.recovery_kind": decision.kind.value}):
        return _publish_recovery_action(rt, action, envelope, contract, decision, dispatch)


def _publish_recovery_action(rt: Runtime, action: store.ActionRow, envelope: Envelope, contract: Any,
                             decision: Decision, dispatch: Dispatch) -> dict[str, Any]:
    kind = WORKFLOW[decision.kind]
    spec = getattr(contract.recovery, kind)
    actor = rt.settings.worker_id
    try:
        derived, _ = derive_envelope(rt, action, envelope, spec, kind)
        message = recovery_signed_message(rt.settings, derived)
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
    published = publish_message(rt.conn, dispatch, message, derived, seal_key=rt.seal_key, queue="compensate",
                                kind=kind, parent_action_id=action.action_id, actor=actor,
                                settings=rt.settings)
    red = for_envelope(action.signed_envelope, contract.sensitive_fields).merged(
        for_envelope(message["envelope"], rt.contract(derived.action_type).sensitive_fields))
    with store.transaction(rt.conn) as cur:
        store.append_event_txn(cur, action.action_id, "recovery_action_published", actor,
                               {"recovery_action": derived.action_id, "kind": kind, "action_type": derived.action_type,
                                "target": derived.target.model_dump(mode="json"), "arguments": derived.arguments,
                                "idempotency_key": derived.idempotency_key, "already_published": published["republished"]},
                               red)
    return {"status": decision.kind.value, "action_id": action.action_id, "recovery_action": derived.action_id}
