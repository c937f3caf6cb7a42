"""Servers whose answer disagrees with what they did, through the runtime (stdio, sandboxed).

- A server that lies (answers "refund issued" without applying it): verification reads the system
  of record, finds the refund absent, and the same envelope is called again; the refund exists
  once. A server that lies every time never yields a success: the attempts the approval allows are
  spent and the action ends without an effect, never ``completed_verified``.
- A server that fails after committing (an error answer for an applied refund): the error is not
  taken at its word either; verification finds the refund and nothing is called again.

The witness counts what the server was handed; the system of record's effects log what it applied.
"""

from __future__ import annotations

from ledger.states import ActionStatus, Outcome
from proofline_kit.sor import store as sor
from tests.conftest import Stack
from tests.helpers import evidence_of, new_account, refund_env, refund_under_fault


def test_a_lie_is_caught_by_verification_and_the_refund_is_paid_once(stack: Stack) -> None:
    env = refund_env(stack, new_account(stack))
    row = refund_under_fault(stack, env, "lie", remaining=1)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
    calls = stack.witness.calls(key=env.idempotency_key)
    assert len(calls) == 2 and not any(c.is_error for c in calls)  # both answers said "issued"
    assert [c["outcome"] for c in evidence_of(stack, env.action_id, "tool_called")] == [
        Outcome.completed_unverified.value, Outcome.completed_unverified.value]
    assert [v["finding"] for v in evidence_of(stack, env.action_id, "verification_finished")] == ["absent", "expected"]
    assert stack.effects(env.idempotency_key) == 1
    # The refund the action reports is the one the system of record holds, not the invented one.
    paid = sor.find_refund_by_key(stack.sor_db, env.idempotency_key)["refund"]["id"]
    assert row.result["values"]["refund_id"] == paid


def test_a_server_that_always_lies_never_yields_a_success(stack: Stack) -> None:
    env = refund_env(stack, new_account(stack))
    row = refund_under_fault(stack, env, "lie", remaining=-1)
    assert row.outcome != Outcome.completed_verified
    assert row.outcome == Outcome.failed_before_side_effect, (row.status, row.reason_code)
    attempts = min(env.retry_policy.max_attempts, env.authority_budget.max_calls)
    assert stack.witness.count(key=env.idempotency_key) == attempts
    assert len(evidence_of(stack, env.action_id, "tool_called")) == attempts
    assert {v["finding"] for v in evidence_of(stack, env.action_id, "verification_finished")} == {"absent"}
    assert stack.effects(env.idempotency_key) == 0


def test_failure_after_commit_is_settled_by_the_read_and_not_retried(stack: Stack) -> None:
    env = refund_env(stack, new_account(stack))
    row = refund_under_fault(stack, env, "fail_after_commit", remaining=1)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
    [call] = stack.witness.calls(key=env.idempotency_key)
    assert call.is_error is True  # the server said it failed
    [recorded] = evidence_of(stack, env.action_id, "tool_called")
    assert recorded["outcome"] in (Outcome.unknown_outcome.value, Outcome.failed_after_side_effect.value)
    assert evidence_of(stack, env.action_id, "verification_finished")[-1]["finding"] == "expected"
    assert stack.effects(env.idempotency_key) == 1


def test_a_result_nested_too_deeply_is_recorded_as_unreadable_and_settled_by_the_read(stack: Stack) -> None:
    """The ticket is created, and the answer carries a value nested 100 levels deep (past the limit
    every later step relies on): the call's evidence is still recorded (``tool_called``, unknown
    outcome, ``extraction_failed``), once, and the verification read settles what happened. (JSON
    text nested past the parser's own stack is refused the same way: tests/unit/test_contracts.py.)"""
    from tests.helpers import ticket_env

    env = ticket_env(stack)
    sor.set_fault(stack.sor_db, "create_ticket", "deep_nesting", remaining=1)
    try:
        stack.publish(env)
        row = stack.wait_settled(env.action_id, timeout=60)
    finally:
        sor.clear_faults(stack.sor_db, "create_ticket")
    [called] = evidence_of(stack, env.action_id, "tool_called")
    assert (called["outcome"], called["reason_code"]) == (Outcome.unknown_outcome.value, "extraction_failed"), called
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert stack.effects(env.idempotency_key) == 1 and stack.witness.count(key=env.idempotency_key) == 1


def test_a_refund_applied_twice_is_found_prohibited_and_handed_to_recovery(stack: Stack) -> None:
    """The server pays the refund twice and answers as if once: verification's read by key finds two
    refunds, a prohibited change (never verified), and recovery takes it from there."""
    account = new_account(stack)
    env = refund_env(stack, account)
    row = refund_under_fault(stack, env, "apply_twice", remaining=1)
    [finished] = evidence_of(stack, env.action_id, "verification_finished")
    assert finished["finding"] == "prohibited", finished
    assert row.finding == "prohibited" and row.outcome != Outcome.completed_verified
    decided = evidence_of(stack, env.action_id, "recovery_decided")
    assert decided and decided[0]["reason"] == "verification_failed", decided
    assert (decided[0]["facts"]["finding"], decided[0]["facts"]["outcome"]) == ("prohibited", "failed_after_side_effect")
    assert len(sor.find_refund_by_key(stack.sor_db, env.idempotency_key)["refunds"]) == 2
    assert stack.witness.count(key=env.idempotency_key) == 1  # one call, two effects: the server's doing
