"""Issue 3: recovery on the real stack. Each test injects its situation for real and checks both
the ledger and the system of record's own effects log."""

from __future__ import annotations

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.controller import publish_message
from proofline.errors import IdempotencyConflict
from proofline_kit.sor import store as sor
from recovery.cancel import cancel
from tests.conftest import Stack
from tests.helpers import (
    LosingBroker,
    new_account,
    refund_env,
    run_of,
    run_settled,
    ticket_env,
)
from worker.dispatch import CeleryDispatch


def test_cancelling_a_queued_step_cancels_it_and_unwinds_the_run(stack: Stack) -> None:
    steps = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: ticket_env(stack, **kw)])
    sor.set_fault(stack.sor_db, "create_ticket", "delay", remaining=1, delay_seconds=1.5)
    stack.publish_run(steps)
    result = cancel(stack.operator, CeleryDispatch(stack.app), steps[1].action_id, "ops@example.com", "not needed")
    assert result["disposition"] == "cancelled"
    row = stack.action(steps[1].action_id)
    assert (row.status, row.outcome) == (ActionStatus.cancelled, Outcome.not_started)
    # The run cannot complete any more: the step that did run is compensated once verified.
    run_settled(stack, steps[0].run_id, expect="compensated")
    assert stack.action(steps[0].action_id).outcome == Outcome.compensated
    assert sor.find_ticket_by_key(stack.sor_db, steps[0].idempotency_key)["ticket"]["status"] == "closed"
    assert stack.effects(steps[1].idempotency_key) == 0
    assert "tool_called" not in stack.events(steps[1].action_id)


def test_a_run_is_recorded_whole_before_its_first_step_is_sent(stack: Stack) -> None:
    """Every step of a run is recorded in the transaction that records the first, so a first step
    that settles at once never finds a run shorter than it is (it was then settled ``completed``
    with its second step never run)."""
    steps = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: ticket_env(stack, **kw)])
    stack.publish_run(steps)
    with stack.conn.cursor() as cur:
        cur.execute("""SELECT action_id, event, xmin::text AS tx FROM ledger_events
                       WHERE action_id = ANY(%s) AND event IN ('published', 'pending')""",
                    ([e.action_id for e in steps],))
        recorded = {(r["action_id"], r["event"]): r["tx"] for r in cur.fetchall()}
    assert set(recorded) == {(steps[0].action_id, "published"), (steps[1].action_id, "pending")}
    assert len(set(recorded.values())) == 1
    assert run_settled(stack, steps[0].run_id, expect="completed")["steps"][1]["outcome"] == "completed_verified"


def test_a_run_with_a_conflicting_step_is_refused_whole(stack: Stack) -> None:
    first = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: ticket_env(stack, **kw)])
    stack.publish(ticket_env(stack, action_id=first[1].action_id))  # that id, other arguments
    with pytest.raises(IdempotencyConflict):
        stack.publish_run(first)
    assert stack.action(first[0].action_id) is None  # nothing of the run is recorded, nothing sent
    assert "publish_refused" in stack.events(first[1].action_id)


def test_a_step_recorded_after_the_one_before_it_settled_still_runs(stack: Stack) -> None:
    """A controller publishing a run's steps one by one (``hold=True`` for the later ones) can have
    its first step settle before the second is recorded. The run is not complete then: it settles
    only once the reconciler has released the late step and that step is verified."""
    steps = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: ticket_env(stack, **kw)])
    dispatch = CeleryDispatch(stack.app)
    publish_message(stack.conn, dispatch, stack.message(steps[0]), steps[0], seal_key=stack.seal_key,
                    settings=stack.settings)
    assert stack.wait_settled(steps[0].action_id).outcome == Outcome.completed_verified
    publish_message(stack.conn, dispatch, stack.message(steps[1]), steps[1], seal_key=stack.seal_key,
                    settings=stack.settings, hold=True)
    settled = run_settled(stack, steps[0].run_id, expect="completed")
    assert [s["action_id"] for s in settled["steps"]] == [e.action_id for e in steps]
    assert "released" in stack.events(steps[1].action_id)
    assert stack.effects(steps[1].idempotency_key) == 1


def test_lost_broker_message_is_redriven_by_the_reconciler(stack: Stack) -> None:
    env = refund_env(stack, new_account(stack))
    broker = LosingBroker()
    publish_message(stack.conn, broker, stack.message(env), env, seal_key=stack.seal_key, settings=stack.settings)
    assert len(broker.lost) == 1
    row = stack.wait_settled(env.action_id, timeout=60)
    assert row.outcome == Outcome.completed_verified
    redriven = [e for e in stack.timeline(env.action_id) if e["event"] == "redriven"]
    assert redriven and redriven[0]["evidence"]["reason"] == "not_started"
    assert stack.effects(env.idempotency_key) == 1


def test_irreversible_action_needs_its_approval_and_the_last_place(stack: Stack) -> None:
    plain = refund_env(stack, new_account(stack), irreversible=True)
    stack.publish(plain)
    row = stack.wait_settled(plain.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "point_of_no_return_refused")
    assert stack.effects(plain.idempotency_key) == 0
    # With the right approval but not last in its run: refused as well, before any effect.
    steps = run_of(stack, [
        lambda **kw: refund_env(stack, new_account(stack), irreversible=True,
                                approval_extra={"covers_irreversible": True}, **kw),
        lambda **kw: ticket_env(stack, **kw),
    ])
    stack.publish_run(steps)
    first = stack.wait_settled(steps[0].action_id)
    assert (first.outcome, first.reason_code) == (Outcome.not_started, "point_of_no_return_refused")
    assert stack.effects(steps[0].idempotency_key) == 0
    # Last, approved, after a verified step: it executes, and the ledger says compensation is unavailable.
    ok = run_of(stack, [
        lambda **kw: ticket_env(stack, **kw),
        lambda **kw: refund_env(stack, new_account(stack), irreversible=True,
                                approval_extra={"covers_irreversible": True}, **kw),
    ])
    stack.publish_run(ok)
    last = stack.wait_settled(ok[1].action_id, timeout=60)
    assert last.outcome == Outcome.completed_verified
    revalidated = next(e for e in stack.timeline(ok[1].action_id) if e["event"] == "revalidated")["evidence"]
    assert revalidated["point_of_no_return"]["compensation"] == "not available"




def test_retry_never_calls_on_a_target_that_changed_meanwhile(stack: Stack) -> None:
    """The first attempt timed out before the server acted (effect proven absent); before the
    retry runs, someone else changes the account. The retry's preconditions fail: it is not
    adapted to the new state and never calls; verification confirms nothing of ours exists."""
    account = new_account(stack)
    env = refund_env(stack, account, timeout_seconds=1.0)
    sor.set_fault(stack.sor_db, "issue_refund", "delay", remaining=1, delay_seconds=3.0)
    stack.publish(env)
    stack.wait_event(env.action_id, "tool_called", timeout=30)
    sor.bump_version(stack.sor_db, "account", account)  # within the retry's backoff
    row = stack.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.not_started, "stale_version")
    decided = next(e for e in stack.timeline(env.action_id) if e["event"] == "recovery_decided")["evidence"]
    assert decided["decision"] == "retry" and decided["backoff_seconds"] >= 1.0
    assert stack.events(env.action_id).count("tool_called") == 1
    assert stack.effects(env.idempotency_key) == 0
