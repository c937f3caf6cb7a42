"""The deterministic recovery decision: recorded facts in, exactly one recovery kind out.

A pure function of what the ledger recorded (the outcome class, the verification finding, the
attempts made, the time left, the contract's recovery block), so the same facts always give the
same decision and nothing a model says can choose or skip it. The caller writes the decision and
its inputs to the ledger (``recovery/recover.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ledger.states import Outcome, RecoveryKind, VerificationFinding
from proofline.contracts import Recovery


@dataclass(frozen=True)
class Facts:
    outcome: Outcome | None
    finding: VerificationFinding | None
    attempts: int
    max_attempts: int
    seconds_left: float
    #: Seconds a retry needs at least (backoff + the call's timeout) before the absolute deadline.
    retry_cost_seconds: float
    is_compensation: bool
    irreversible: bool
    cancel_requested: bool = False
    #: A later step of this action's run failed, so this verified step must be undone.
    run_failed: bool = False

    def as_evidence(self) -> dict[str, object]:
        data = asdict(self)
        data["outcome"] = self.outcome.value if self.outcome else None
        data["finding"] = self.finding.value if self.finding else None
        return data


@dataclass(frozen=True)
class Decision:
    kind: RecoveryKind
    reason: str
    #: Containment (a kill switch on the tool for the tenant) goes with the decision.
    contain: bool = False


def decide(facts: Facts, policy: Recovery) -> Decision:
    absent = proven_absent(facts.outcome, facts.finding)
    if facts.is_compensation:
        # A compensation that did not reach a safe state is never improvised around.
        if absent and _can_retry(facts):
            return Decision(RecoveryKind.retry, "compensation_made_no_change")
        return Decision(RecoveryKind.manual_intervention, "compensation_failed", contain=True)
    if facts.finding == VerificationFinding.evidence_conflict:
        # Which reading is true is not known: nothing is undone or retried on a guess.
        if policy.evidence_conflict == "contain":
            return Decision(RecoveryKind.containment, "evidence_conflict", contain=True)
        return Decision(RecoveryKind.manual_intervention, "evidence_conflict")
    if absent:
        if facts.cancel_requested or facts.run_failed:
            # Nothing happened and nobody wants it any more: never re-drive it.
            return Decision(RecoveryKind.manual_intervention, "effect_absent_not_wanted")
        if policy.transient_failure != "retry_same_idempotency_key":
            return Decision(RecoveryKind.manual_intervention, "policy_manual")
        if _can_retry(facts):
            return Decision(RecoveryKind.retry, "effect_absent_retry_same_key")
        return Decision(RecoveryKind.manual_intervention, "retries_exhausted")
    if facts.outcome == Outcome.unknown_outcome or facts.finding in (None, VerificationFinding.unavailable):
        return Decision(RecoveryKind.manual_intervention, "outcome_not_provable")
    if facts.irreversible:
        return Decision(RecoveryKind.manual_intervention, "irreversible_no_compensation", contain=True)
    if facts.outcome in (Outcome.accepted, Outcome.partially_completed) and \
            facts.finding == VerificationFinding.not_reached:
        if policy.partial_completion != "manual" and policy.compensation:
            return Decision(RecoveryKind.compensation, "partial_completion", contain=True)
        return Decision(RecoveryKind.manual_intervention, "partial_completion", contain=True)
    undo_reason = ("run_step_failed" if facts.run_failed else "cancel_after_effect" if facts.cancel_requested
                   else "verification_failed")
    wants_undo = facts.run_failed or facts.cancel_requested or facts.finding in (
        VerificationFinding.prohibited, VerificationFinding.not_reached)
    if not wants_undo:
        return Decision(RecoveryKind.manual_intervention, "no_rule_matched")
    choice = policy.verification_failure
    if choice == "native_rollback" and policy.rollback:
        return Decision(RecoveryKind.native_rollback, undo_reason)
    if choice == "forward_recovery" and policy.forward and not facts.run_failed:
        return Decision(RecoveryKind.forward_recovery, undo_reason)
    if choice in ("manual_or_compensate", "compensate") and policy.compensation:
        return Decision(RecoveryKind.compensation, undo_reason)
    if choice == "contain":
        return Decision(RecoveryKind.containment, undo_reason, contain=True)
    if choice == "manual":
        return Decision(RecoveryKind.manual_intervention, "policy_manual")
    return Decision(RecoveryKind.manual_intervention, "no_recovery_workflow", contain=True)


def proven_absent(outcome: Outcome | None, finding: VerificationFinding | None) -> bool:
    """Whether the recorded facts prove the action made no side effect. A read beats a recorded
    classification: "absent" is what the system of record showed, or, with no read at all, a call
    that provably failed before any side effect. (An operator retry asks the same question.)"""
    return finding == VerificationFinding.absent or (finding is None and outcome == Outcome.failed_before_side_effect)


def _can_retry(facts: Facts) -> bool:
    return facts.attempts < facts.max_attempts and facts.seconds_left > facts.retry_cost_seconds
