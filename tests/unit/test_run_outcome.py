"""A multi-step run's outcome, derived from its steps alone (``recovery/runs.py``): which step counts
as verified, which as failed (a step aborted because an earlier one failed is not a failure of its
own), and the run outcome for each way a run can end or still be going."""

from __future__ import annotations

import ast
import inspect

import pytest

from ledger.states import ActionStatus, Outcome
from recovery.runs import Step, run_outcome

S = ActionStatus
O_ = Outcome


def step(n: int, status: ActionStatus, outcome: Outcome | None = None, reason: str | None = None) -> Step:
    return Step(action_id=f"act-{n}", step=n, status=status, outcome=outcome, reason_code=reason, message=None)


def verified(n: int) -> Step:
    return step(n, S.closed, O_.completed_verified)


def compensated(n: int) -> Step:
    """A verified step undone after a later step failed: closed as recovered, not as success."""
    return step(n, S.closed, O_.compensated, "compensated")


def failed(n: int, outcome: Outcome = O_.failed_after_side_effect) -> Step:
    return step(n, S.escalated, outcome, "verification_failed")


def aborted(n: int) -> Step:
    """What the coordinator records for a pending step once an earlier step has failed."""
    return step(n, S.closed, O_.not_started, "run_aborted")


def compensation_failed(n: int) -> Step:
    return step(n, S.escalated, O_.compensation_failed, "compensation_failed")


# --- Step.verified ----------------------------------------------------------------------------------


def test_a_closed_completed_verified_step_is_verified():
    assert verified(1).verified


@pytest.mark.parametrize(("status", "outcome"), [
    (S.escalated, O_.completed_verified),
    (S.cancelled, O_.completed_verified),
    (S.verifying, O_.completed_verified),
    (S.recovery, O_.completed_verified),
    (S.closed, O_.completed_unverified),
    (S.closed, O_.compensated),
    (S.closed, O_.accepted),
    (S.closed, None),
], ids=lambda v: getattr(v, "value", str(v)))
def test_only_closed_and_completed_verified_is_verified(status, outcome):
    assert not step(1, status, outcome).verified


# --- Step.failed ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "outcome", "reason"), [
    (S.closed, O_.failed_after_side_effect, "verification_failed"),
    (S.closed, O_.failed_before_side_effect, "precondition_failed"),
    (S.closed, O_.not_started, "precondition_failed"),
    (S.escalated, O_.unknown_outcome, "outcome_not_provable"),
    (S.escalated, O_.compensation_failed, "compensation_failed"),
    (S.escalated, O_.partially_completed, "partial_completion"),
    (S.escalated, None, "outcome_not_provable"),
    (S.cancelled, O_.not_started, "cancelled"),
], ids=lambda v: getattr(v, "value", str(v)))
def test_a_settled_step_without_a_good_outcome_failed(status, outcome, reason):
    assert step(1, status, outcome, reason).failed


def test_a_run_aborted_step_is_not_a_failure():
    s = aborted(3)
    assert not s.failed
    assert not s.verified


def test_the_same_step_with_another_reason_is_a_failure():
    # Only the coordinator's abort marker excuses a not_started step; any other reason is its own failure.
    assert step(3, S.closed, O_.not_started, "precondition_failed").failed


@pytest.mark.parametrize("status", [S.pending, S.published, S.executing, S.verifying, S.recovery])
@pytest.mark.parametrize("outcome", [None, O_.failed_after_side_effect, O_.unknown_outcome])
def test_a_step_still_in_flight_has_not_failed(status, outcome):
    assert not step(1, status, outcome).failed


@pytest.mark.parametrize("s", [verified(1), compensated(1)], ids=["verified", "compensated"])
def test_verified_and_compensated_steps_have_not_failed(s):
    assert not s.failed


def test_a_cancelled_step_ends_its_run_even_when_compensated():
    # Cancellation stops the run: the steps after it will not run, so the run must unwind.
    assert step(1, S.cancelled, O_.compensated, "compensated").failed


# --- run_outcome ------------------------------------------------------------------------------------


RUNS = [
    pytest.param([verified(1)], "completed", id="one-step-verified"),
    pytest.param([verified(1), verified(2), verified(3)], "completed", id="all-verified"),
    pytest.param([verified(1), step(2, S.executing)], "in_progress", id="second-step-executing"),
    pytest.param([step(1, S.published), step(2, S.pending)], "in_progress", id="first-step-published"),
    pytest.param([verified(1), step(2, S.verifying, O_.completed_unverified), step(3, S.pending)], "in_progress",
                 id="second-step-verifying"),
    pytest.param([verified(1), step(2, S.pending), step(3, S.pending)], "in_progress",
                 id="next-step-not-yet-released"),
    pytest.param([step(1, S.recovery, O_.completed_verified, "run_step_failed"), failed(2), aborted(3)],
                 "in_progress", id="first-step-being-compensated"),
    pytest.param([verified(1), step(2, S.recovery, O_.completed_unverified), step(3, S.pending)], "in_progress",
                 id="second-step-in-recovery"),
    pytest.param([verified(1), step(2, S.executing), failed(3)], "in_progress",
                 id="failure-while-another-step-runs"),
    pytest.param([compensated(1), failed(2), aborted(3)], "compensated", id="first-compensated-second-failed"),
    pytest.param([compensated(1), compensated(2), failed(3, O_.unknown_outcome)], "compensated",
                 id="two-compensated-third-unknown"),
    pytest.param([verified(1), failed(2), aborted(3)], "partially_completed", id="first-still-verified"),
    pytest.param([compensated(1), verified(2), failed(3)], "partially_completed",
                 id="second-not-yet-compensated"),
    pytest.param([compensation_failed(1), failed(2), aborted(3)], "partially_completed",
                 id="compensation-of-first-failed"),
    pytest.param([compensated(1), compensation_failed(2), failed(3)], "partially_completed",
                 id="compensation-of-second-failed"),
    pytest.param([compensation_failed(1), compensated(2), failed(3)], "partially_completed",
                 id="compensation-failed-beside-a-compensated-step"),
    pytest.param([failed(1), aborted(2), aborted(3)], "failed", id="first-failed-rest-aborted"),
    pytest.param([failed(1, O_.failed_before_side_effect)], "failed", id="single-step-failed"),
    pytest.param([step(1, S.closed, O_.not_started, "precondition_failed"), aborted(2)], "failed",
                 id="first-refused-by-precondition"),
]


@pytest.mark.parametrize(("steps", "expected"), RUNS)
def test_run_outcome(steps, expected):
    assert run_outcome(steps) == expected


@pytest.mark.parametrize(("steps", "expected"), RUNS)
def test_run_outcome_does_not_depend_on_the_order_steps_are_given(steps, expected):
    assert run_outcome(list(reversed(steps))) == expected


def test_run_outcome_returns_exactly_the_documented_values_and_the_table_reaches_each():
    """The values in the docstring are the literals ``run_outcome`` returns (read from its source),
    and run over the table's inputs it returns every one of them."""
    documented = set(run_outcome.__doc__.split(",")[0].split(" | "))
    returned = {node.value.value for node in ast.walk(ast.parse(inspect.getsource(run_outcome)))
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant)}
    assert returned == documented
    assert {run_outcome(p.values[0]) for p in RUNS} == documented


def test_one_unverified_step_keeps_a_run_from_completing():
    steps = [verified(1), verified(2), step(3, S.closed, O_.completed_unverified, "verification_failed")]
    assert run_outcome(steps[:2]) == "completed"
    assert run_outcome(steps) != "completed"
