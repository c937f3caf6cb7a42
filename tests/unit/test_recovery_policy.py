"""The recovery decision (``recovery/policy.py``): one table case per branch of ``decide``, over the
repository's real ``recovery:`` blocks and a few hand-built ones for the workflows no contract
declares yet, plus determinism and property tests of the rules that must hold for every input."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.states import Outcome, RecoveryKind, VerificationFinding
from proofline.contracts import DerivedAction, Recovery, load_contract
from proofline.settings import ROOT
from recovery.policy import Decision, Facts, decide

CONTRACTS = ROOT / "contracts"

F = VerificationFinding
K = RecoveryKind


def recovery_of(name: str) -> Recovery:
    return load_contract(CONTRACTS / f"{name}.yaml").recovery


# The real contracts' recovery blocks. Their shape is asserted below, so a contract edit that changes
# what a case exercises fails loudly instead of silently testing something else.
REFUND_ISSUE = recovery_of("refund.issue")  # manual_or_compensate, with a compensation
REFUND_REVERSE = recovery_of("refund.reverse")  # manual, no workflow
SERVICE_RESTART = recovery_of("service.restart")  # manual_or_compensate, no compensation
TICKET_CREATE = recovery_of("ticket.create")  # manual_or_compensate, with a compensation


def derived(action_type: str) -> DerivedAction:
    return DerivedAction(action_type=action_type, target={"type": "'thing'", "id": "after.thing.id"},
                         arguments={"id": "after.thing.id"})


UNDO = derived("thing.undo")
ROLLBACK = derived("thing.rollback")
FORWARD = derived("thing.fix")

ROLLBACK_POLICY = Recovery(verification_failure="native_rollback", rollback=ROLLBACK)
ROLLBACK_WITHOUT_ROLLBACK = Recovery(verification_failure="native_rollback", compensation=UNDO)
FORWARD_POLICY = Recovery(verification_failure="forward_recovery", forward=FORWARD)
COMPENSATE_POLICY = Recovery(verification_failure="compensate", compensation=UNDO)
CONTAIN_POLICY = Recovery(verification_failure="contain", compensation=UNDO, rollback=ROLLBACK, forward=FORWARD)
TRANSIENT_MANUAL = Recovery(transient_failure="manual", compensation=UNDO)
PARTIAL_MANUAL = Recovery(partial_completion="manual", compensation=UNDO)
PARTIAL_COMPENSATE = Recovery(partial_completion="compensate", compensation=UNDO)
EVERYTHING = Recovery(compensation=UNDO, rollback=ROLLBACK, forward=FORWARD)


def test_the_real_recovery_blocks_have_the_shape_the_cases_rely_on():
    assert REFUND_ISSUE.verification_failure == "manual_or_compensate"
    assert REFUND_ISSUE.compensation is not None and REFUND_ISSUE.compensation.action_type == "refund.reverse"
    assert REFUND_REVERSE.verification_failure == "manual"
    assert REFUND_REVERSE.compensation is None and REFUND_REVERSE.rollback is None and REFUND_REVERSE.forward is None
    assert SERVICE_RESTART.verification_failure == "manual_or_compensate"
    assert SERVICE_RESTART.compensation is None
    assert SERVICE_RESTART.partial_completion == "contain_then_evaluate"
    assert TICKET_CREATE.compensation is not None and TICKET_CREATE.compensation.action_type == "ticket.close"
    for policy in (REFUND_ISSUE, REFUND_REVERSE, SERVICE_RESTART, TICKET_CREATE):
        assert policy.transient_failure == "retry_same_idempotency_key"
        assert policy.rollback is None and policy.forward is None


def facts(**overrides: Any) -> Facts:
    """A verified, unremarkable action with retries and time to spare; each case changes what it tests."""
    base: dict[str, Any] = {
        "outcome": Outcome.completed_verified, "finding": F.expected, "attempts": 1, "max_attempts": 3,
        "seconds_left": 120.0, "retry_cost_seconds": 10.0, "is_compensation": False, "irreversible": False,
    }
    base.update(overrides)
    return Facts(**base)


def case(id_: str, f: Facts, policy: Recovery, kind: RecoveryKind, reason: str, contain: bool):
    return pytest.param(f, policy, Decision(kind, reason, contain), id=id_)


ABSENT = {"outcome": Outcome.unknown_outcome, "finding": F.absent}
NOTHING_HAPPENED = {"outcome": Outcome.failed_before_side_effect, "finding": None}
UNPROVEN = {"outcome": Outcome.unknown_outcome, "finding": None}
VIOLATED = {"outcome": Outcome.completed_unverified, "finding": F.prohibited}
PARTIAL = {"outcome": Outcome.partially_completed, "finding": F.not_reached}

CASES = [
    # --- a compensation action -------------------------------------------------------------------
    case("compensation/absent-retries-left", facts(is_compensation=True, **ABSENT), REFUND_REVERSE,
         K.retry, "compensation_made_no_change", False),
    case("compensation/failed-before-effect", facts(is_compensation=True, **NOTHING_HAPPENED), REFUND_REVERSE,
         K.retry, "compensation_made_no_change", False),
    case("compensation/retries-even-when-transient-is-manual", facts(is_compensation=True, **ABSENT),
         TRANSIENT_MANUAL, K.retry, "compensation_made_no_change", False),
    case("compensation/absent-attempts-used-up", facts(is_compensation=True, attempts=3, **ABSENT), REFUND_REVERSE,
         K.manual_intervention, "compensation_failed", True),
    case("compensation/absent-no-time", facts(is_compensation=True, seconds_left=10.0, **ABSENT), REFUND_REVERSE,
         K.manual_intervention, "compensation_failed", True),
    case("compensation/prohibited", facts(is_compensation=True, **VIOLATED), EVERYTHING,
         K.manual_intervention, "compensation_failed", True),
    case("compensation/unknown", facts(is_compensation=True, **UNPROVEN), EVERYTHING,
         K.manual_intervention, "compensation_failed", True),
    case("compensation/not-reached", facts(is_compensation=True, **PARTIAL), EVERYTHING,
         K.manual_intervention, "compensation_failed", True),
    # --- the effect is proven absent ---------------------------------------------------------------
    case("absent/reconciled-absent-retries", facts(**ABSENT), REFUND_ISSUE,
         K.retry, "effect_absent_retry_same_key", False),
    case("absent/failed-before-side-effect-retries", facts(**NOTHING_HAPPENED), TICKET_CREATE,
         K.retry, "effect_absent_retry_same_key", False),
    case("absent/first-attempt-recorded-as-zero", facts(attempts=0, max_attempts=1, **ABSENT), SERVICE_RESTART,
         K.retry, "effect_absent_retry_same_key", False),
    case("absent/just-enough-time", facts(seconds_left=10.5, retry_cost_seconds=10.0, **ABSENT), SERVICE_RESTART,
         K.retry, "effect_absent_retry_same_key", False),
    case("absent/attempts-equal-max", facts(attempts=3, max_attempts=3, **ABSENT), REFUND_ISSUE,
         K.manual_intervention, "retries_exhausted", False),
    case("absent/attempts-over-max", facts(attempts=5, max_attempts=3, **NOTHING_HAPPENED), REFUND_ISSUE,
         K.manual_intervention, "retries_exhausted", False),
    case("absent/time-equals-retry-cost", facts(seconds_left=10.0, retry_cost_seconds=10.0, **ABSENT),
         REFUND_ISSUE, K.manual_intervention, "retries_exhausted", False),
    case("absent/past-deadline", facts(seconds_left=-3.0, **NOTHING_HAPPENED), REFUND_ISSUE,
         K.manual_intervention, "retries_exhausted", False),
    case("absent/transient-manual-never-retries", facts(attempts=0, **ABSENT), TRANSIENT_MANUAL,
         K.manual_intervention, "policy_manual", False),
    case("absent/irreversible-but-nothing-happened", facts(irreversible=True, **NOTHING_HAPPENED), REFUND_ISSUE,
         K.retry, "effect_absent_retry_same_key", False),
    case("absent/never-retried-once-cancelled", facts(cancel_requested=True, **ABSENT),
         EVERYTHING, K.manual_intervention, "effect_absent_not_wanted", False),
    case("absent/never-retried-in-a-failed-run", facts(run_failed=True, **ABSENT),
         EVERYTHING, K.manual_intervention, "effect_absent_not_wanted", False),
    # --- the outcome cannot be proven --------------------------------------------------------------
    case("unprovable/unknown-no-finding", facts(**UNPROVEN), REFUND_ISSUE,
         K.manual_intervention, "outcome_not_provable", False),
    case("unprovable/unknown-with-retries-and-time", facts(attempts=0, seconds_left=3600.0, **UNPROVEN),
         TICKET_CREATE, K.manual_intervention, "outcome_not_provable", False),
    case("unprovable/unknown-read-unavailable", facts(outcome=Outcome.unknown_outcome, finding=F.unavailable),
         EVERYTHING, K.manual_intervention, "outcome_not_provable", False),
    case("unprovable/unknown-though-prohibited-seen", facts(outcome=Outcome.unknown_outcome, finding=F.prohibited),
         TICKET_CREATE, K.manual_intervention, "outcome_not_provable", False),
    case("unprovable/unknown-though-expected-seen", facts(outcome=Outcome.unknown_outcome, finding=F.expected),
         TICKET_CREATE, K.manual_intervention, "outcome_not_provable", False),
    case("unprovable/read-unavailable", facts(outcome=Outcome.completed_unverified, finding=F.unavailable),
         REFUND_ISSUE, K.manual_intervention, "outcome_not_provable", False),
    case("unprovable/no-finding", facts(outcome=Outcome.failed_after_side_effect, finding=None), REFUND_ISSUE,
         K.manual_intervention, "outcome_not_provable", False),
    case("unprovable/no-outcome-no-finding", facts(outcome=None, finding=None), REFUND_ISSUE,
         K.manual_intervention, "outcome_not_provable", False),
    case("unprovable/before-irreversible", facts(irreversible=True, **UNPROVEN), REFUND_ISSUE,
         K.manual_intervention, "outcome_not_provable", False),
    case("unprovable/before-cancel-and-run-failure", facts(cancel_requested=True, run_failed=True, **UNPROVEN),
         EVERYTHING, K.manual_intervention, "outcome_not_provable", False),
    # --- irreversible ------------------------------------------------------------------------------
    case("irreversible/prohibited-with-compensation", facts(irreversible=True, **VIOLATED), TICKET_CREATE,
         K.manual_intervention, "irreversible_no_compensation", True),
    case("irreversible/partial-with-compensation", facts(irreversible=True, **PARTIAL), PARTIAL_COMPENSATE,
         K.manual_intervention, "irreversible_no_compensation", True),
    case("irreversible/run-failed-with-rollback", facts(irreversible=True, run_failed=True), ROLLBACK_POLICY,
         K.manual_intervention, "irreversible_no_compensation", True),
    case("irreversible/cancel-with-forward", facts(irreversible=True, cancel_requested=True), FORWARD_POLICY,
         K.manual_intervention, "irreversible_no_compensation", True),
    case("irreversible/verified-no-trigger", facts(irreversible=True), EVERYTHING,
         K.manual_intervention, "irreversible_no_compensation", True),
    # --- partial completion --------------------------------------------------------------------------
    case("partial/accepted-not-reached-compensates", facts(outcome=Outcome.accepted, finding=F.not_reached),
         REFUND_ISSUE, K.compensation, "partial_completion", True),
    case("partial/partially-completed-compensates", facts(**PARTIAL), TICKET_CREATE,
         K.compensation, "partial_completion", True),
    case("partial/policy-compensate", facts(**PARTIAL), PARTIAL_COMPENSATE,
         K.compensation, "partial_completion", True),
    case("partial/no-compensation-manual", facts(**PARTIAL), SERVICE_RESTART,
         K.manual_intervention, "partial_completion", True),
    case("partial/policy-manual-even-with-compensation", facts(outcome=Outcome.accepted, finding=F.not_reached),
         PARTIAL_MANUAL, K.manual_intervention, "partial_completion", True),
    case("partial/rollback-is-not-used", facts(**PARTIAL), ROLLBACK_POLICY,
         K.manual_intervention, "partial_completion", True),
    case("partial/before-run-failure", facts(run_failed=True, **PARTIAL), ROLLBACK_POLICY,
         K.manual_intervention, "partial_completion", True),
    case("partial/prohibited-is-a-verification-failure", facts(outcome=Outcome.partially_completed,
                                                                finding=F.prohibited),
         REFUND_ISSUE, K.compensation, "verification_failed", False),
    # --- undo: rollback / forward / compensation / containment ---------------------------------------
    case("undo/native-rollback", facts(**VIOLATED), ROLLBACK_POLICY,
         K.native_rollback, "verification_failed", False),
    case("undo/native-rollback-not-reached", facts(outcome=Outcome.completed_unverified, finding=F.not_reached),
         ROLLBACK_POLICY, K.native_rollback, "verification_failed", False),
    case("undo/native-rollback-for-failed-run", facts(run_failed=True), ROLLBACK_POLICY,
         K.native_rollback, "run_step_failed", False),
    case("undo/native-rollback-without-rollback", facts(**VIOLATED), ROLLBACK_WITHOUT_ROLLBACK,
         K.manual_intervention, "no_recovery_workflow", True),
    case("undo/forward", facts(**VIOLATED), FORWARD_POLICY,
         K.forward_recovery, "verification_failed", False),
    case("undo/forward-after-cancel", facts(cancel_requested=True), FORWARD_POLICY,
         K.forward_recovery, "cancel_after_effect", False),
    case("undo/forward-never-for-failed-run", facts(run_failed=True), FORWARD_POLICY,
         K.manual_intervention, "no_recovery_workflow", True),
    case("undo/forward-without-forward", facts(**VIOLATED), Recovery(verification_failure="forward_recovery"),
         K.manual_intervention, "no_recovery_workflow", True),
    case("undo/manual-or-compensate", facts(**VIOLATED), REFUND_ISSUE,
         K.compensation, "verification_failed", False),
    case("undo/manual-or-compensate-run-failed", facts(run_failed=True), TICKET_CREATE,
         K.compensation, "run_step_failed", False),
    case("undo/manual-or-compensate-cancel", facts(cancel_requested=True), TICKET_CREATE,
         K.compensation, "cancel_after_effect", False),
    case("undo/compensate", facts(outcome=Outcome.failed_after_side_effect, finding=F.prohibited), COMPENSATE_POLICY,
         K.compensation, "verification_failed", False),
    case("undo/compensate-without-compensation", facts(**VIOLATED), Recovery(verification_failure="compensate"),
         K.manual_intervention, "no_recovery_workflow", True),
    case("undo/manual-or-compensate-without-compensation", facts(**VIOLATED), SERVICE_RESTART,
         K.manual_intervention, "no_recovery_workflow", True),
    case("undo/manual", facts(**VIOLATED), REFUND_REVERSE,
         K.manual_intervention, "policy_manual", False),
    case("undo/manual-ignores-available-workflows", facts(**VIOLATED),
         Recovery(verification_failure="manual", compensation=UNDO, rollback=ROLLBACK, forward=FORWARD),
         K.manual_intervention, "policy_manual", False),
    case("undo/contain", facts(**VIOLATED), CONTAIN_POLICY,
         K.containment, "verification_failed", True),
    case("undo/contain-after-cancel", facts(cancel_requested=True), CONTAIN_POLICY,
         K.containment, "cancel_after_effect", True),
    case("undo/contain-run-failed", facts(run_failed=True), CONTAIN_POLICY,
         K.containment, "run_step_failed", True),
    case("undo/run-failure-named-before-cancel", facts(run_failed=True, cancel_requested=True), EVERYTHING,
         K.compensation, "run_step_failed", False),
    case("undo/cancel-named-before-verification", facts(cancel_requested=True, **VIOLATED), EVERYTHING,
         K.compensation, "cancel_after_effect", False),
    case("undo/tolerated-but-run-failed", facts(finding=F.tolerated, run_failed=True), REFUND_ISSUE,
         K.compensation, "run_step_failed", False),
    case("undo/no-outcome-recorded-prohibited", facts(outcome=None, finding=F.prohibited), REFUND_ISSUE,
         K.compensation, "verification_failed", False),
    case("undo/accepted-prohibited", facts(outcome=Outcome.accepted, finding=F.prohibited), COMPENSATE_POLICY,
         K.compensation, "verification_failed", False),
    # --- independent sources disagree: never undone or retried on a guess ----------------------------
    case("conflict/escalate-despite-compensation", facts(outcome=Outcome.completed_unverified,
                                                         finding=F.evidence_conflict), REFUND_ISSUE,
         K.manual_intervention, "evidence_conflict", False),
    case("conflict/contain", facts(outcome=Outcome.completed_unverified, finding=F.evidence_conflict),
         Recovery(evidence_conflict="contain", compensation=UNDO), K.containment, "evidence_conflict", True),
    # --- nothing to recover ----------------------------------------------------------------------
    case("none/verified", facts(), EVERYTHING, K.manual_intervention, "no_rule_matched", False),
    case("none/tolerated", facts(outcome=Outcome.completed_unverified, finding=F.tolerated), REFUND_ISSUE,
         K.manual_intervention, "no_rule_matched", False),
    case("none/accepted-expected", facts(outcome=Outcome.accepted, finding=F.expected), TICKET_CREATE,
         K.manual_intervention, "no_rule_matched", False),
    case("none/contain-policy-needs-a-trigger", facts(), CONTAIN_POLICY,
         K.manual_intervention, "no_rule_matched", False),
]


@pytest.mark.parametrize(("f", "policy", "expected"), CASES)
def test_decide(f: Facts, policy: Recovery, expected: Decision):
    assert decide(f, policy) == expected


# --- properties over every combination of facts --------------------------------------------------------

seconds = st.floats(min_value=-60, max_value=600, allow_nan=False, allow_infinity=False)


@st.composite
def all_facts(draw: st.DrawFn) -> Facts:
    cost = draw(st.floats(min_value=0, max_value=120, allow_nan=False, allow_infinity=False))
    # Exactly at, just either side of, or anywhere around the retry cost: the boundary matters.
    left = draw(st.sampled_from([cost, cost + 0.001, cost - 0.001]) | seconds)
    return Facts(
        outcome=draw(st.none() | st.sampled_from(Outcome)),
        finding=draw(st.none() | st.sampled_from(VerificationFinding)),
        attempts=draw(st.integers(min_value=0, max_value=6)),
        max_attempts=draw(st.integers(min_value=0, max_value=6)),
        seconds_left=left,
        retry_cost_seconds=cost,
        is_compensation=draw(st.booleans()),
        irreversible=draw(st.booleans()),
        cancel_requested=draw(st.booleans()),
        run_failed=draw(st.booleans()),
    )


all_policies = st.builds(
    Recovery,
    transient_failure=st.sampled_from(["retry_same_idempotency_key", "manual"]),
    partial_completion=st.sampled_from(["contain_then_evaluate", "compensate", "manual"]),
    verification_failure=st.sampled_from(["manual_or_compensate", "compensate", "native_rollback",
                                          "forward_recovery", "manual", "contain"]),
    compensation=st.none() | st.just(UNDO),
    rollback=st.none() | st.just(ROLLBACK),
    forward=st.none() | st.just(FORWARD),
) | st.sampled_from([REFUND_ISSUE, REFUND_REVERSE, SERVICE_RESTART, TICKET_CREATE])

def reasons_in_source() -> set[str]:
    """Every reason ``decide`` can give, read from its source: the literal second argument of each
    ``Decision(...)``, or every literal of the expression a named one was assigned from."""
    tree = ast.parse(inspect.getsource(decide))
    assigned = {target.id: node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)}
    reasons: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Decision":
            arg = node.args[1]
            values = ast.walk(assigned[arg.id]) if isinstance(arg, ast.Name) else [arg]
            reasons |= {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    return reasons


def test_the_table_reaches_every_kind_and_every_reason_decide_can_give():
    """Run over the table's inputs, ``decide`` itself reaches every recovery kind and every reason
    in its source: a new branch without a case fails here."""
    decisions = [decide(*p.values[:2]) for p in CASES]
    assert {d.kind for d in decisions} == set(RecoveryKind)
    assert {d.reason for d in decisions} == reasons_in_source()


@settings(max_examples=500, deadline=None)
@given(f=all_facts(), policy=all_policies)
def test_decide_depends_only_on_the_values_of_its_inputs(f: Facts, policy: Recovery):
    """Equal copies of the facts and the policy get the same decision, and nothing is mutated."""
    before_facts, before_policy = f.as_evidence(), policy.model_dump()
    first = decide(f, policy)
    assert decide(dataclasses.replace(f), policy.model_copy(deep=True)) == first
    assert f.as_evidence() == before_facts
    assert policy.model_dump() == before_policy


def test_evidence_records_enum_values_and_every_fact():
    f = facts(outcome=Outcome.unknown_outcome, finding=F.absent, cancel_requested=True)
    evidence = f.as_evidence()
    assert evidence["outcome"] == "unknown_outcome"
    assert evidence["finding"] == "absent"
    assert set(evidence) == {field.name for field in dataclasses.fields(Facts)}
    assert evidence["cancel_requested"] is True and evidence["run_failed"] is False
    assert json.loads(json.dumps(evidence)) == evidence


def test_evidence_keeps_missing_outcome_and_finding_as_null():
    evidence = facts(outcome=None, finding=None).as_evidence()
    assert evidence["outcome"] is None and evidence["finding"] is None


WORKFLOWS = {K.compensation: "compensation", K.native_rollback: "rollback", K.forward_recovery: "forward"}


@settings(max_examples=1500, deadline=None)
@given(f=all_facts(), policy=all_policies)
def test_decision_invariants(f: Facts, policy: Recovery):
    decision = decide(f, policy)
    assert isinstance(decision.kind, RecoveryKind) and decision.reason

    # (a) an unknown outcome is never retried blindly: only a read proving the effect absent allows it.
    if f.outcome == Outcome.unknown_outcome and f.finding != F.absent:
        assert decision.kind != K.retry
    # (b) never past the attempt budget or the deadline.
    if f.attempts >= f.max_attempts or f.seconds_left <= f.retry_cost_seconds:
        assert decision.kind != K.retry
    # (c) nothing undoes an irreversible action.
    if f.irreversible:
        assert decision.kind not in WORKFLOWS
    # (d) a contract that says transient failures are manual is obeyed, except for compensations.
    if policy.transient_failure == "manual" and not f.is_compensation:
        assert decision.kind != K.retry
    # (e) the facts can be written to the ledger as JSON.
    evidence = f.as_evidence()
    assert json.loads(json.dumps(evidence, allow_nan=False)) == evidence

    # A retry needs an effect proven absent.
    if decision.kind == K.retry:
        assert f.outcome == Outcome.failed_before_side_effect or f.finding == F.absent
    # A workflow is only chosen when the contract declares how to build it, and never by a compensation.
    if decision.kind in WORKFLOWS:
        assert getattr(policy, WORKFLOWS[decision.kind]) is not None
        assert not f.is_compensation
    # Forward recovery never answers a failed run: the run's verified steps must be undone.
    if f.run_failed:
        assert decision.kind != K.forward_recovery
    # A compensation that failed to reach a safe state goes to an operator with containment.
    if f.is_compensation:
        assert decision.kind in (K.retry, K.manual_intervention)
        assert decision.contain == (decision.kind == K.manual_intervention)
    # Containment is always accompanied by the kill switch.
    if decision.kind == K.containment:
        assert decision.contain and policy.verification_failure == "contain"
