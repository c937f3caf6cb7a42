"""Verification: read the system of record through an independent, read-only path and decide
whether the approved post-condition holds.

Its own Celery task on its own queue, with its own key derived from the action's. It never reads
the write response; it polls within the contract's bounds and evaluates expected, tolerated and
prohibited outcomes. Lack of evidence is never success.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ledger import store
from ledger.redact import current_redactor, for_envelope
from ledger.states import ActionStatus, IdempotencyStatus, Outcome, VerificationFinding
from proofline.canonical import sha256_hex
from proofline.conditions import CompiledConditions, Variables, build_arguments, holds
from proofline.contracts import Contract, Verification, extract
from proofline.envelope import CancellationBehaviour, Envelope
from proofline.errors import ConditionError, McpUnavailable, ProoflineError, ResultTooLarge, TransitionRefused
from proofline.telemetry import context as telemetry_context
from proofline.telemetry import metrics, tracing
from recovery.operation_record import read_operation_record
from worker import calls, faultpoints, sandbox_events
from worker.dispatch import Dispatch
from worker.record_call import verification_key
from worker.results import measure, result_limit
from worker.runtime import Runtime

log = logging.getLogger(__name__)

READS_KEPT = 5


@dataclass
class Observation:
    finding: VerificationFinding
    after: dict[str, Any] | None = None
    reads: int = 0
    failed_reads: int = 0
    last_error: str | None = None
    kept: list[dict[str, Any]] = field(default_factory=list)
    #: Conditions that could not be evaluated (recorded, bounded): they counted as not holding.
    condition_errors: list[dict[str, str]] = field(default_factory=list)


def judge(verification: Verification, variables: dict[str, Any], *, settled: bool,
          errors: list[dict[str, str]] | None = None, compiled: CompiledConditions | None = None) -> VerificationFinding:
    """Evaluate one read. ``settled`` is true once the expected consistency delay has passed.

    Prohibited wins over everything; expected needs every condition true; a condition that cannot
    be evaluated counts as not holding, never as holding.
    """

    bound = Variables(variables)  # converted to CEL once for every condition of this read

    def true(expr: str) -> bool:
        try:
            return holds(expr, bound, compiled)
        except ConditionError as exc:
            if errors is not None and len(errors) < READS_KEPT:
                errors.append({"expr": expr[:200], "reason_code": exc.code, "detail": exc.detail[:300]})
            return False

    if any(true(expr) for expr in verification.prohibited):
        return VerificationFinding.prohibited
    if all(true(expr) for expr in verification.expected):
        return VerificationFinding.expected
    if verification.tolerated and any(true(expr) for expr in verification.tolerated):
        return VerificationFinding.tolerated
    if settled and verification.absent and true(verification.absent):
        return VerificationFinding.absent
    return VerificationFinding.not_reached


def observe(rt: Runtime, envelope: Envelope, contract: Contract, base: dict[str, Any]) -> Observation:
    """Poll the read path until a decisive finding or the bound."""
    v = contract.verification
    if envelope.expected_postconditions:
        # The controller's extra post-conditions must hold too (checked against the limits at revalidation).
        v = v.model_copy(update={"expected": (*v.expected, *envelope.expected_postconditions)})
    server = rt.server(envelope.server.name)
    read = contract.verification_read
    started = time.monotonic()
    bound = started + v.max_duration_seconds
    obs = Observation(VerificationFinding.unavailable)
    limit = result_limit(rt.settings, server, contract)
    compiled = contract.compiled()
    while True:
        settled = time.monotonic() - started >= v.consistency_delay_seconds
        try:
            arguments = build_arguments(read.arguments, base, compiled)
            with tracing.span("proofline.verification_read", **{"proofline.tool": read.tool}):
                trace_meta = tracing.carrier()
                result = rt.mcp.run(server, "read", lambda c, a=arguments, m=trace_meta: calls.read_tool(  # type: ignore[arg-type]
                    c, tool=read.tool, arguments=a, timeout_seconds=contract.timeout_seconds, trace_meta=m))
            size = measure(result).size
            if size > limit:
                raise ResultTooLarge(f"read tool {read.tool} answered {size} bytes; the limit is {limit}")
            if getattr(result, "is_error", False):
                text = "".join(getattr(b, "text", "") for b in result.content or [])
                raise McpUnavailable(f"read tool {read.tool} answered an error: {text[:200]}")
            after = extract(result, read.extract)
        except BaseException as exc:  # noqa: BLE001 - an unreadable system is "unavailable", not success
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            if not isinstance(exc, ProoflineError):
                rt.mcp.discard(server, "read")
            obs.failed_reads += 1
            obs.last_error = repr(exc)[:300]
            finding = None
        else:
            obs.reads += 1
            obs.after = after
            finding = judge(v, {**base, "after": after}, settled=settled, errors=obs.condition_errors,
                            compiled=compiled)
            if len(obs.kept) < READS_KEPT or finding != VerificationFinding.tolerated:
                obs.kept.append({"t_ms": round((time.monotonic() - started) * 1000), "finding": finding.value})
            if finding in (VerificationFinding.expected, VerificationFinding.prohibited, VerificationFinding.absent):
                obs.finding = finding
                return obs
        if time.monotonic() + v.poll_interval_seconds > bound:
            # The bound passed: a read path that never answered is "unavailable"; one that answered
            # but never showed the expected state is "not reached".
            obs.finding = VerificationFinding.not_reached if obs.reads else VerificationFinding.unavailable
            return obs
        time.sleep(v.poll_interval_seconds)


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
}


def _cancel_arrived(cur, action_id: str) -> bool:
    """Whether a cancellation is recorded now, read under the row lock: one that commits before this
    transaction is seen here, one that comes after it finds the action settled."""
    cur.execute("SELECT cancel_requested_at FROM actions WHERE action_id = %s FOR UPDATE", (action_id,))
    row = cur.fetchone()
    return row is not None and row["cancel_requested_at"] is not None


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
        return _verify_loaded(rt, conn, store.ActionRow.from_row(row) if row else None, action_id, dispatch, stages)
    finally:
        store.end_held_read(conn)


def _verify_loaded(rt: Runtime, conn: Any, action: store.ActionRow | None, action_id: str, dispatch: Dispatch,
                   stages: tracing.Stages) -> dict[str, Any]:
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
    # The downstream's own record of the operation first (evidence only), then the authoritative read.
    operation_record, record_expired = read_operation_record(rt, envelope, contract, base)
    began = time.monotonic()
    obs = observe(rt, envelope, contract, base)
    read_seconds = time.monotonic() - began
    stages.note(**{"proofline.verification_finding": obs.finding.value})
    status, outcome, record_status, reason = DISPOSITION[obs.finding]
    blocked = (action.recovery_data or {}).get("retry_blocked_by")
    if blocked and obs.finding == VerificationFinding.absent:
        # A retry found its preconditions broken and nothing of ours downstream: it never starts.
        status, outcome, record_status, reason = ActionStatus.closed, Outcome.not_started, None, blocked
    if action.cancel_requested_at is not None:
        status, outcome, record_status, reason = _cancel_disposition(
            envelope, obs.finding, (status, outcome, record_status, reason))
    if obs.finding == VerificationFinding.unavailable and action.outcome == Outcome.unknown_outcome:
        outcome = None  # an unknown outcome stays unknown: we never learned more
    if obs.finding == VerificationFinding.not_reached and action.outcome == Outcome.accepted:
        outcome = Outcome.partially_completed
    evidence = {
        "verification_key": verification_key(envelope), "finding": obs.finding.value, "reads": obs.reads,
        "failed_reads": obs.failed_reads, "last_error": obs.last_error, "timeline": obs.kept,
        "after": obs.after, "prior_outcome": action.outcome.value if action.outcome else None,
        "read_tool": contract.verification_read.tool, "identity": "read",
    }
    if obs.condition_errors:
        evidence["condition_errors"] = obs.condition_errors
    if operation_record is not None:
        evidence["operation_record"] = operation_record
    recovered = None
    if obs.finding == VerificationFinding.expected and not (action.result or {}).get("values"):
        # The response was lost; the original result is recovered from the system of record.
        # What the call's own result weighed (past the size limit) stays next to the recovered values.
        recovered = {**(action.result or {}), "values": obs.after, "recovered_by": "verification"}
    # Polling may have outlasted the session's idle timeout: then rt.conn is a fresh connection (the
    # old one, and the load's transaction with it, is gone) and the verdict has a transaction of its
    # own; the guarded move from verifying re-checks what the load saw either way.
    begun = rt.conn is conn and store.holds_read(conn)
    if not begun:
        store.end_held_read(conn)
        conn = rt.conn
    faultpoints.hit("before_verify_commit")
    stages.enter("proofline.final_transition", **{"proofline.outcome": (outcome or action.outcome).value
                                                  if (outcome or action.outcome) else None})
    try:
        # Two flights: the row lock (and a cancellation that arrived meanwhile), then the verdict
        # with its COMMIT; a move another verifier made first is refused by the database.
        with store.pipelined(conn, begun=begun) as cur:
            if action.cancel_requested_at is None and _cancel_arrived(cur, action_id):
                # Cancelled while verification was reading the system of record: the cancellation
                # decides the disposition as if it had been there from the start.
                status, outcome, record_status, reason = _cancel_disposition(
                    envelope, obs.finding, (status, outcome, record_status, reason))
            events = [("verification_finished", evidence)]
            if record_expired is not None:
                events.insert(0, ("operation_record_expired", record_expired))
            if record_status is not None:
                store.settle_idempotency_txn(cur, envelope.idempotency_key, record_status,
                                             {"verified": obs.finding.value,
                                              "after_digest": sha256_hex(obs.after) if obs.after is not None else None},
                                             red)
            if status == ActionStatus.escalated:
                events.append(("escalated", {"reason_code": reason, "evidence": "verification read path unavailable"}))
            events.append(("final_state" if status in (ActionStatus.closed, ActionStatus.cancelled)
                           else "handed_to_recovery" if status == ActionStatus.recovery else "escalated_state",
                            {"status": status.value, "outcome": (outcome or action.outcome).value if (outcome or action.outcome) else None,
                             "reason_code": reason}))
            store.transition_txn(cur, action_id, [ActionStatus.verifying], status, outcome=outcome,
                                 finding=obs.finding.value, reason_code=reason, result=recovered,
                                 recovery_data={"after": obs.after} if obs.after is not None else None,
                                 redactor=red, events=events, actor=rt.settings.worker_id, deferred=True)
    except TransitionRefused:
        # Another verifier settled it first; our reads are kept as evidence, nothing else changes.
        with store.transaction(conn) as cur:
            store.append_event_txn(cur, action_id, "verification_superseded", rt.settings.worker_id, evidence, red)
        return {"status": "superseded", "action_id": action_id}
    # Only a verification whose finding was recorded is measured (a superseded one read in vain).
    metrics.VERIFICATION_SECONDS.labels(action.action_type, obs.finding.value).observe(read_seconds)
    if obs.finding == VerificationFinding.expected:
        metrics.PUBLISH_TO_VERIFIED_SECONDS.labels(action.action_type).observe(
            max(time.time() - action.published_at.timestamp(), 0.0))
    log.info("verified", extra={"action_id": action_id, "event": "verification_finished", "finding": obs.finding.value})
    from recovery.settle import after_settle

    after_settle(rt.conn, rt.settings.worker_id, action_id, dispatch, envelope=envelope, status=status,
                 outcome=outcome or action.outcome)
    final = outcome or action.outcome
    return {"outcome": final.value if final else None, "reason_code": reason, "status": status.value,
            "action_id": action_id, "finding": obs.finding.value}
