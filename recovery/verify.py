"""Verification: read the system of record through an independent, read-only path and decide
whether the approved post-condition holds.

Its own Celery task on its own queue, with its own key derived from the action's. It never reads
the write response; it polls within the contract's bounds and evaluates expected, tolerated and
prohibited outcomes. Lack of evidence is never success.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ledger import evidence, rechecks, store
from ledger.redact import Redactor, current_redactor, for_envelope
from ledger.states import ActionStatus, IdempotencyStatus, Outcome, VerificationFinding
from proofline.canonical import sha256_hex
from proofline.contracts import Contract
from proofline.envelope import CancellationBehaviour, Envelope
from proofline.errors import TransitionRefused
from proofline.telemetry import context as telemetry_context
from proofline.telemetry import metrics, tracing
from recovery.operation_record import read_operation_record
from worker import capture, faultpoints, sandbox_events
from worker.dispatch import Dispatch
from worker.evidence import decide as decide_evidence
from worker.evidence import reconcile_unknown
from worker.runtime import Runtime
from worker.verification import Observation, finding_evidence, judge, observe

__all__ = ["DISPOSITION", "judge", "observe", "verify"]

log = logging.getLogger(__name__)

# finding -> (status, outcome or None to keep, idempotency status or None to keep, reason code)
DISPOSITION: dict[VerificationFinding, tuple[ActionStatus, Outcome | None, IdempotencyStatus | None, str]] = {
    VerificationFinding.expected: (ActionStatus.closed, Outcome.completed_verified, IdempotencyStatus.completed,
                                   "verified"),
    VerificationFinding.prohibited: (ActionStatus.recovery, Outcome.failed_after_side_effect,
                                     IdempotencyStatus.completed, "verification_failed"),
    VerificationFinding.not_reached: (ActionStatus.recovery, None, None, "verification_failed"),
    VerificationFinding.absent: (ActionStatus.recovery, Outcome.failed_before_side_effect, IdempotencyStatus.failed,
                                 "effect_absent"),
    VerificationFinding.unavailable: (ActionStatus.escalated, Outcome.completed_unverified, None,
                                      "verification_unavailable"),
    VerificationFinding.evidence_conflict: (ActionStatus.escalated, Outcome.completed_unverified, None,
                                            "evidence_conflict"),
}
#: Why an escalation from verification happened, as its ``escalated`` event says.
ESCALATION_EVIDENCE = {VerificationFinding.unavailable: "verification read path unavailable",
                       VerificationFinding.evidence_conflict: "independent evidence sources disagree"}


def disposition(contract: Contract, finding: VerificationFinding):
    """The verdict's row change for ``finding``; a conflict goes to recovery (containment) when the
    contract's recovery policy says ``contain``, to an operator otherwise."""
    status, outcome, record_status, reason = DISPOSITION[finding]
    if finding == VerificationFinding.evidence_conflict and contract.recovery.evidence_conflict == "contain":
        status = ActionStatus.recovery
    return status, outcome, record_status, reason


def _cancel_disposition(envelope: Envelope, finding: VerificationFinding, current):
    """A cancelled action's final disposition, once verification knows the external state."""
    status, outcome, record_status, reason = current
    if finding == VerificationFinding.absent:
        return ActionStatus.cancelled, Outcome.failed_before_side_effect, IdempotencyStatus.failed, "cancelled"
    if finding == VerificationFinding.expected:
        if envelope.cancellation == CancellationBehaviour.reconcile_then_compensate:
            return ActionStatus.recovery, Outcome.completed_verified, IdempotencyStatus.completed, "cancel_after_effect"
        # The server ignored the cancellation and the effect is proven: that is the final state.
        return ActionStatus.closed, Outcome.completed_verified, IdempotencyStatus.completed, "cancel_too_late"
    return status, outcome, record_status, reason


def verdict_evidence(rt: Runtime, action: store.ActionRow, red: Redactor, status: ActionStatus,
                     outcome: Outcome | None, obs: Observation, reason: str,
                     recovered: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """The signed statement of what the verdict's commit leaves on the row (recovery derives only
    from a row that matches it)."""
    data = dict(action.recovery_data or {})
    if obs.after is not None:
        data["after"] = evidence.as_stored({"after": obs.after}, red)["after"]
    return evidence.signed_event(rt.worker_key, evidence.statement(
        action_id=action.action_id, idempotency_key=action.idempotency_key, status=status, outcome=outcome,
        finding=obs.finding.value, reason_code=reason, recovery_data=data, signer=rt.settings.worker_id,
        result=evidence.as_stored(recovered, red) if recovered is not None else action.result))


@sandbox_events.records_audit
def verify(rt: Runtime, action_id: str, dispatch: Dispatch) -> dict[str, Any]:
    """Verify one action (its stages are spans of the action's trace when tracing is on)."""
    stages = tracing.Stages()
    try:
        return _verify(rt, action_id, dispatch, stages)
    finally:
        stages.close()


def _verify(rt: Runtime, action_id: str, dispatch: Dispatch, stages: tracing.Stages) -> dict[str, Any]:
    # The load opens the verdict's transaction (one flight); nothing is locked or written while the
    # read path is polled. Whatever ends this task with it still open (a skip, an error) rolls it back.
    conn = rt.conn
    row = store.begin_with_read(conn, "SELECT * FROM actions WHERE action_id = %s", (action_id,))
    try:
        return _verify_loaded(rt, conn, store.ActionRow.from_row(row) if row else None, action_id, dispatch, stages,
                              row["ledger_seq"] if row else 0)
    finally:
        store.end_held_read(conn)


def _verify_loaded(rt: Runtime, conn: Any, action: store.ActionRow | None, action_id: str, dispatch: Dispatch,
                   stages: tracing.Stages, loaded_seq: int) -> dict[str, Any]:
    if action is None or action.status != ActionStatus.verifying:
        return {"status": "skipped", "action_id": action_id, "current": action.status.value if action else None}
    # Conditions compare with the arguments as signed; the stored envelope is a redacted copy.
    envelope = Envelope.model_validate(action.signed_envelope)
    contract = rt.contract(envelope.action_type)
    doc = envelope.model_dump(mode="json")
    red = for_envelope(doc, contract.sensitive_fields)
    current_redactor.set(red)
    telemetry_context.bind(action_id, run_id=action.run_id, tenant=action.tenant, action_type=action.action_type,
                           irreversible=envelope.irreversible, stage="verify")
    stages.describe(**{**tracing.about(envelope), "proofline.tool": contract.verification_read.tool})
    stages.enter("proofline.verification")
    base = {"envelope": doc, "args": doc["arguments"], "target": doc["target"],
            "before": action.recovery_data.get("before") or {}, "result": (action.result or {}).get("values") or {}}
    rt.mcp.action_id = action_id  # what the sandbox audit finds during these reads is this action's
    rt.mcp.request_policy = contract.server_requests  # and how its servers' requests are answered
    # The downstream's own record of the operation first (evidence only), then the authoritative read.
    operation_record, record_expired = read_operation_record(rt, envelope, contract, base)
    began = time.monotonic()
    obs = observe(rt, envelope, contract, base)
    primary_seconds = time.monotonic() - began
    verdict, readings = decide_evidence(rt, contract, obs, envelope.server.name, primary_seconds, base,
                                        contract.verification.max_duration_seconds - primary_seconds)
    obs.finding = verdict.finding
    reconciled = None
    if obs.finding == VerificationFinding.unavailable and action.outcome == Outcome.unknown_outcome:
        # The system of record cannot say; another system's search may at least say it happened.
        reconciled = reconcile_unknown(rt, contract, base, contract.verification.max_duration_seconds)
    if reconciled is not None:
        readings.append(reconciled.record())
    read_seconds = time.monotonic() - began
    stages.note(**{"proofline.verification_finding": obs.finding.value})
    status, outcome, record_status, reason = disposition(contract, obs.finding)
    blocked = (action.recovery_data or {}).get("retry_blocked_by")
    if blocked and obs.finding == VerificationFinding.absent:
        # A retry found its preconditions broken and nothing of ours downstream: it never starts.
        status, outcome, record_status, reason = ActionStatus.closed, Outcome.not_started, None, blocked
    if action.cancel_requested_at is not None:
        status, outcome, record_status, reason = _cancel_disposition(
            envelope, obs.finding, (status, outcome, record_status, reason))
    if obs.finding in ESCALATION_EVIDENCE and action.outcome == Outcome.unknown_outcome:
        outcome = None  # an unknown outcome stays unknown: we never learned more
    if reconciled is not None and reconciled.obs.finding == VerificationFinding.expected:
        # The search saw the effect: it happened (not verified), and no retry may call again.
        outcome, record_status = Outcome.completed_unverified, IdempotencyStatus.completed
    if obs.finding == VerificationFinding.not_reached and action.outcome == Outcome.accepted:
        outcome = Outcome.partially_completed
    evidence = finding_evidence(envelope, contract, obs, action.outcome)
    if contract.verification.sources:
        evidence["evidence"] = verdict.summary
    if reconciled is not None:
        evidence["reconciled"] = {"source": reconciled.source,
                                  "happened": reconciled.obs.finding == VerificationFinding.expected}
    if operation_record is not None:
        evidence["operation_record"] = operation_record
    recovered = None
    if obs.finding == VerificationFinding.expected and not (action.result or {}).get("values"):
        # The response was lost; the original result is recovered from the system of record.
        # What the call's own result weighed (past the size limit) stays next to the recovered values.
        recovered = {**(action.result or {}), "values": obs.after, "recovered_by": "verification"}
    faultpoints.hit("before_verify_commit", action_id)  # a hold here is reads that took that long
    # Polling may have outlasted the session's idle timeout: then rt.conn is a fresh connection (the
    # old one, and the load's transaction with it, is gone) and the verdict has a transaction of its
    # own; the guarded move from verifying re-checks what the load saw either way.
    begun = rt.conn is conn and store.holds_read(conn)
    if not begun:
        store.end_held_read(conn)
        conn = rt.conn
    stages.enter("proofline.final_transition", **{"proofline.outcome": (outcome or action.outcome).value
                                                  if (outcome or action.outcome) else None})
    superseded = "settled"  # why a refused move is superseded, as its event says
    try:
        # Two flights: the row lock (with a cancellation that arrived meanwhile and any verdict
        # recorded since the load), then the verdict with its COMMIT; a move another verifier made
        # first is refused by the database.
        with store.pipelined(conn, begun=begun) as cur:
            cancelled, overtaken = store.lock_for_verdict_txn(cur, action_id, loaded_seq)
            if overtaken:
                # Another verifier's verdict landed while this one read, and the retry it led to may
                # have brought the row back to ``verifying``: these reads are of the attempt before.
                superseded = "later_verdict"
                raise TransitionRefused(f"{action_id}: a verdict was recorded after this verification loaded it",
                                        action_id=action_id)
            if action.cancel_requested_at is None and cancelled:
                # Cancelled while verification was reading the system of record: the cancellation
                # decides the disposition as if it had been there from the start.
                status, outcome, record_status, reason = _cancel_disposition(
                    envelope, obs.finding, (status, outcome, record_status, reason))
            # Each read is its own evidence record, before the verdict it led to.
            events = [("evidence_read", r) for r in readings if contract.verification.all_sources]
            events.append(("verification_finished", evidence))
            if record_expired is not None:
                events.insert(0, ("operation_record_expired", record_expired))
            if record_status is not None:
                store.settle_idempotency_txn(cur, envelope.idempotency_key, record_status,
                                             {"verified": obs.finding.value,
                                              "after_digest": sha256_hex(obs.after) if obs.after is not None else None},
                                             red)
            if status == ActionStatus.escalated:
                events.append(("escalated", {"reason_code": reason, "evidence": ESCALATION_EVIDENCE.get(
                    obs.finding, "verification read path unavailable")}))
            recheck = contract.verification.recheck
            if recheck is not None and (status, outcome or action.outcome) == (ActionStatus.closed,
                                                                                Outcome.completed_verified):
                # The re-checks the contract asks for, due from this verdict: in its transaction.
                rechecks.schedule_txn(cur, action_id, envelope.idempotency_key, recheck)
                events.append(("recheck_scheduled", rechecks.plan(recheck)))
            # The worker's signed statement of this verdict, then the final state (always the last event).
            events.append(verdict_evidence(rt, action, red, status, outcome or action.outcome, obs, reason, recovered))
            events.append(("final_state" if status in (ActionStatus.closed, ActionStatus.cancelled)
                           else "handed_to_recovery" if status == ActionStatus.recovery else "escalated_state",
                            {"status": status.value, "outcome": (outcome or action.outcome).value if (outcome or action.outcome) else None,
                             "reason_code": reason}))
            store.transition_txn(cur, action_id, [ActionStatus.verifying], status, outcome=outcome,
                                 finding=obs.finding.value, reason_code=reason, result=recovered,
                                 recovery_data={"after": obs.after} if obs.after is not None else None,
                                 redactor=red, events=events, actor=rt.settings.worker_id, deferred=True)
    except TransitionRefused:
        # Another verifier settled it first ("settled"), or settled an earlier attempt of it since this
        # one loaded the row ("later_verdict"); our reads are kept as evidence, nothing else changes.
        with store.transaction(conn) as cur:
            store.append_event_txn(cur, action_id, "verification_superseded", rt.settings.worker_id,
                                   {**evidence, "superseded": superseded}, red)
        return {"status": "superseded", "action_id": action_id}
    # Only a verification whose finding was recorded is measured (a superseded one read in vain).
    metrics.VERIFICATION_SECONDS.labels(action.action_type, obs.finding.value).observe(read_seconds)
    if obs.finding == VerificationFinding.expected:
        metrics.PUBLISH_TO_VERIFIED_SECONDS.labels(action.action_type).observe(
            max(time.time() - action.published_at.timestamp(), 0.0))
    log.info("verified", extra={"action_id": action_id, "event": "verification_finished", "finding": obs.finding.value})
    capture.capture_reads(rt, action_id, contract, readings)  # its own transaction, after the verdict's
    from recovery.settle import after_settle

    after_settle(rt.conn, rt.settings.worker_id, action_id, dispatch, envelope=envelope, status=status,
                 outcome=outcome or action.outcome)
    final = outcome or action.outcome
    return {"outcome": final.value if final else None, "reason_code": reason, "status": status.value,
            "action_id": action_id, "finding": obs.finding.value}
