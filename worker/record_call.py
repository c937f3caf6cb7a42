"""Recording a classified tool call: the ``tool_called`` evidence, the idempotency record, the
action's new status and the lease's release, in one commit fenced by the lease token; with the
verdict too when the first verification read, made in place, proved the post-condition."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ledger import evidence, rechecks, store
from ledger.redact import Redactor
from ledger.states import ActionStatus, IdempotencyStatus, Outcome, VerificationFinding
from proofline.canonical import sha256_hex
from proofline.envelope import Envelope
from worker import faultpoints, sandbox_events
from worker.classify import CallReport, Classification
from worker.lease import Locks, release_lease_txn, unlock_sql
from worker.results import values_reference
from worker.runtime import Runtime

# What the idempotency record becomes once a call has been classified.
RECORD_AFTER_CALL = {
    Outcome.completed_unverified: IdempotencyStatus.completed,
    Outcome.accepted: IdempotencyStatus.completed,
    Outcome.failed_after_side_effect: IdempotencyStatus.completed,
    Outcome.failed_before_side_effect: IdempotencyStatus.failed,
    Outcome.unknown_outcome: IdempotencyStatus.unknown,
}



def result_evidence(envelope: Envelope, verdict: Classification, report: CallReport) -> dict[str, Any]:
    evidence: dict[str, Any] = {
        "outcome": verdict.outcome.value, "reason_code": verdict.reason_code,
        "elapsed_ms": round(report.elapsed_seconds * 1000, 1), "progress_total": report.progress_total,
        "progress": list(report.progress), **verdict.evidence,
    }
    if verdict.operation_id:
        evidence["downstream_operation_id"] = verdict.operation_id
    if envelope.evidence.record_tool_result and verdict.values is not None:
        # The values are stored once, on the action row; the ledger binds them by digest.
        evidence.update(values_reference(verdict.values) or {})
    if report.unsandboxed is not None:
        evidence["unsandboxed"] = report.unsandboxed
    evidence.update(report.request)
    if report.task is not None:
        evidence["mcp_task"] = report.task
    if verdict.reason_code == "cancelled_in_flight" and "mcp_request_id" in report.request:
        # The SDK's notifications/cancelled names the request it cancels: this call's.
        evidence["cancelled_request_id"] = report.request["mcp_request_id"]
    return evidence


@dataclass(frozen=True)
class FirstRead:
    """The verification read the execute task made in place: what it observed (a
    ``worker.verification.Observation``), how long it took, and its ``verification_finished``
    evidence."""

    obs: Any
    seconds: float
    evidence: dict[str, Any]

    @property
    def proves(self) -> bool:
        return self.obs.finding == VerificationFinding.expected


def write_result_txn(rt: Runtime, envelope: Envelope, red: Redactor, verdict: Classification,
                      evidence: dict[str, Any], token: int, locks: Locks,
                      violation: dict[str, Any] | None = None, audit: sandbox_events.Pending = None,
                      first: FirstRead | None = None) -> tuple[bool, bool]:
    """Record the classified call, settle the idempotency record, release the lease: one commit.
    When ``first`` proves the post-condition and no cancellation has arrived (read under the row
    lock, one round trip more), the same commit records the verdict and closes the action.

    Returns whether a failed-before-side-effect call will be retried (same envelope, same key), and
    whether the action was closed verified here.
    """
    aid, actor = envelope.action_id, rt.settings.worker_id
    proves = first is not None and first.proves
    if proves:
        faultpoints.hit("before_verify_commit", aid)
    retry = False
    if verdict.outcome == Outcome.failed_before_side_effect:
        remaining = envelope.deadline.timestamp() - time.time()
        retry = remaining > envelope.retry_policy.backoff_seconds + envelope.timeout_seconds
    failed_before = verdict.outcome == Outcome.failed_before_side_effect
    # One flight with its BEGIN and COMMIT; only a failed-before call waits for the attempts count
    # (whether it is retried), one round trip more. A stale token or a refused move rolls it all back.
    with store.pipelined(rt.conn) as cur:
        # A cancellation that arrived during the call leaves the disposition to the verification
        # task, which weighs it (recovery/verify.py).
        verified = proves and not store.cancel_arrived_txn(cur, aid)
        after = first.obs.after if verified and first is not None else None
        attempts = store.update_idempotency_txn(
            cur, envelope.idempotency_key, fencing_token=token, allowed=[IdempotencyStatus.in_progress],
            status=RECORD_AFTER_CALL[verdict.outcome],
            result={**(values_reference(verdict.values) or {}), "operation_id": verdict.operation_id,
                    "outcome": verdict.outcome.value,
                    **({"verified": VerificationFinding.expected.value, "after_digest": sha256_hex(after)}
                       if verified else {})},
            redactor=red, deferred=not failed_before)
        events: list[tuple[str, dict[str, Any]]] = [("tool_called", evidence)]
        if violation is not None:
            events.append((sandbox_events.EVENT, violation))
        events += sandbox_events.write_pending_txn(cur, rt, envelope.action_id, audit)
        if failed_before:
            assert attempts is not None
            retry = retry and attempts < min(envelope.retry_policy.max_attempts, envelope.authority_budget.max_calls)
            status = ActionStatus.published if retry else ActionStatus.closed
            events.append(("retry_scheduled" if retry else "retries_exhausted",
                           {"attempts": attempts, "cause": verdict.reason_code}))
        else:
            status = ActionStatus.verifying
            if not verified:
                handoff = {"verification_key": verification_key(envelope)}
                if first is not None:  # what the read made in place found (the task reads again)
                    handoff["first_read"] = first.obs.finding.value
                events.append(("verification_enqueued", handoff))
        store.transition_txn(
            cur, aid, [ActionStatus.executing], status, outcome=verdict.outcome, reason_code=verdict.reason_code,
            result=_action_result(verdict),
            recovery_data={"downstream_operation_id": verdict.operation_id} if verdict.operation_id else None,
            redactor=red, events=events, actor=actor, deferred=True)
        if verified and first is not None:
            recheck = rt.contract(envelope.action_type).verification.recheck
            scheduled = []
            if recheck is not None:
                # The contract's re-checks, due from this verdict, in its transaction.
                rechecks.schedule_txn(cur, aid, envelope.idempotency_key, recheck)
                scheduled = [("recheck_scheduled", rechecks.plan(recheck))]
            store.transition_txn(
                cur, aid, [ActionStatus.verifying], ActionStatus.closed, outcome=Outcome.completed_verified,
                finding=VerificationFinding.expected.value, reason_code="verified",
                recovery_data={"after": after} if after is not None else None, redactor=red,
                events=[("verification_finished", {**first.evidence, "in_place": True}), *scheduled,
                        _closed_evidence(rt, envelope, red, verdict, first),
                        ("final_state", {"status": ActionStatus.closed.value,
                                         "outcome": Outcome.completed_verified.value, "reason_code": "verified"})],
                actor=actor, deferred=True)
        release_lease_txn(cur, aid, token)
        cur.execute(*unlock_sql(locks))
    return retry, verified


def _closed_evidence(rt: Runtime, envelope: Envelope, red: Redactor, verdict: Classification,
                     first: FirstRead) -> tuple[str, dict[str, Any]]:
    """The signed statement of the action closed verified in place: what the row holds after this commit."""
    after = evidence.as_stored({"after": first.obs.after}, red)["after"]
    return evidence.signed_event(rt.worker_key, evidence.statement(
        action_id=envelope.action_id, idempotency_key=envelope.idempotency_key, status=ActionStatus.closed,
        outcome=Outcome.completed_verified, finding=VerificationFinding.expected.value, reason_code="verified",
        result=evidence.as_stored(_action_result(verdict), red),
        recovery_data={"before": evidence.as_stored(first.obs.before), "after": after}, signer=rt.settings.worker_id))


def _action_result(verdict: Classification) -> dict[str, Any] | None:
    """The one stored copy of the result's values (or, past the size limit, only what it weighed)."""
    if verdict.values is not None:
        return {"values": verdict.values, **(values_reference(verdict.values) or {})}
    if "result_digest" in verdict.evidence:
        return {"oversize": True, "result_size": verdict.evidence["result_size"],
                "result_digest": verdict.evidence["result_digest"]}
    return None


def verification_key(envelope: Envelope) -> str:
    """Verification has its own key, derived from the action's, so it is deduplicated separately."""
    return "verify-" + envelope.idempotency_key
