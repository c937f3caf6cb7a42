"""Reason codes that no other test provokes, each through the real stack: the code lands on the
action (or its events), and the effect count in the system of record says what was really done.

- ``deadline_passed``: the signed message reaches a worker after its absolute deadline.
- ``policy_version_rejected``: an envelope approved under a policy version the runtime no longer
  accepts.
- ``target_read_failed``: the writer's precondition read is down; nothing is sent while it is, the
  same envelope is retried, and it runs once the read is back.
- ``cancel_too_late``: the cancellation arrives after the system of record applied the effect;
  verification proves the effect and the action closes done, not cancelled; also when it arrives
  while the execute task's own verification read is in flight (the verdict is then the task's).
- ``early_delivery_ignored``: a later step of a run is delivered before the runtime released it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from ledger.states import ActionStatus, Outcome
from proofline.controller import publish_message
from proofline_kit.sor import store as sor
from recovery.cancel import cancel
from tests.conftest import Stack, wait_for
from tests.helpers import LosingBroker, evidence_of, failed_reads, run_of, run_settled, ticket_env
from worker.dispatch import CeleryDispatch


def test_deadline_passed_before_execution_sends_nothing(stack: Stack) -> None:
    env = ticket_env(stack, deadline_in=timedelta(seconds=2), timeout_seconds=1)
    broker = LosingBroker()  # recorded as published, never queued: it reaches a worker late
    publish_message(stack.conn, broker, stack.message(env), env, settings=stack.settings)
    wait_for(lambda: datetime.now(UTC) > env.deadline + timedelta(seconds=0.5), 10, what="the deadline to pass")
    stack.deliver(broker.lost[0])
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.not_started, "deadline_passed")
    refused = evidence_of(stack, env.action_id, "revalidation_failed")
    assert [r["reason_code"] for r in refused] == ["deadline_passed"]
    assert "tool_called" not in stack.events(env.action_id)
    assert stack.witness.count(key=env.idempotency_key) == 0
    assert stack.effects(env.idempotency_key) == 0


def test_policy_version_no_longer_accepted_is_refused(stack: Stack) -> None:
    accepted = stack.settings.accepted_policy_versions
    retired = min(accepted) - 1
    env = ticket_env(stack, policy_version=retired)
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.not_started,
                                                          "policy_version_rejected")
    refused = evidence_of(stack, env.action_id, "revalidation_failed")
    assert refused[0]["reason_code"] == "policy_version_rejected" and str(retired) in refused[0]["detail"]
    assert stack.witness.count(key=env.idempotency_key) == 0
    assert stack.effects(env.idempotency_key) == 0
    # The same action approved under an accepted version runs (the refusal was the version alone).
    ok = ticket_env(stack, policy_version=max(accepted))
    stack.publish(ok)
    assert stack.wait_settled(ok.action_id).outcome == Outcome.completed_verified
    assert stack.witness.count(key=ok.idempotency_key) == 1
    assert stack.effects(ok.idempotency_key) == 1


def test_target_read_down_sends_nothing_and_retries_the_same_envelope(stack: Stack) -> None:
    env = ticket_env(stack)
    start = stack.witness.mark()
    sor.set_read_outage(stack.sor_db, True, role="writer")  # the precondition read; verification's is up
    try:
        stack.publish(env)
        wait_for(lambda: failed_reads(stack, env.action_id) >= 2, 30,
                 what="two refused precondition reads")
        assert "tool_called" not in stack.events(env.action_id)
        # The reads really reached the writer and were answered with an error; no write was sent.
        reads = stack.witness.calls(tool="find_ticket_by_key", server="sor", since=start)
        assert len(reads) >= 2 and all(c.is_error for c in reads if c.answered)
        assert stack.witness.count(key=env.idempotency_key) == 0
        assert stack.effects(env.idempotency_key) == 0
    finally:
        sor.set_read_outage(stack.sor_db, False, role="writer")
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    events = stack.events(env.action_id)
    waits = evidence_of(stack, env.action_id, "precheck_unavailable")
    assert waits and {w["reason_code"] for w in waits} == {"target_read_failed"}
    # Every refused read came before the one call, and that call is the only one.
    assert events.count("tool_called") == 1
    assert max(i for i, e in enumerate(events) if e == "precheck_unavailable") < events.index("tool_called")
    assert stack.witness.count(key=env.idempotency_key) == 1
    assert stack.effects(env.idempotency_key) == 1


def test_a_cancel_during_the_read_in_place_leaves_the_verdict_to_the_verification_task(stack: Stack) -> None:
    """The execute task has called and read (the post-condition holds) when the cancellation is
    recorded: its commit finds it under the row lock, records the result alone, and the
    verification task weighs the cancellation (cancel_too_late: the effect stands)."""
    from tests.faults.test_seed_validation_suite import held, wait_held

    env = ticket_env(stack)
    with held(stack, "before_verify_commit", env.action_id) as shot:
        stack.publish(env)
        wait_held(stack, "before_verify_commit", shot)
        assert stack.action(env.action_id).status == ActionStatus.executing
        answer = cancel(stack.operator, CeleryDispatch(stack.app), env.action_id, "ops@example.com", "changed mind")
        assert answer["accepted"] and answer["status_at_request"] == "executing"
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.completed_verified,
                                                          "cancel_too_late")
    [enqueued] = evidence_of(stack, env.action_id, "verification_enqueued")
    assert enqueued["first_read"] == "expected"  # proven in place, yet not decided there
    [finished] = evidence_of(stack, env.action_id, "verification_finished")
    assert "in_place" not in finished
    assert stack.events(env.action_id).count("tool_called") == 1
    assert stack.effects(env.idempotency_key) == 1


def test_cancel_after_the_effect_closes_as_cancel_too_late(stack: Stack) -> None:
    env = ticket_env(stack)
    # Verification's read path is down, so the action waits in verifying with its effect applied.
    sor.set_read_outage(stack.sor_db, True, role="reader")
    try:
        stack.publish(env)
        wait_for(lambda: (stack.action(env.action_id).status == ActionStatus.verifying
                          and stack.effects(env.idempotency_key) == 1), 30, what="the effect, then verification")
        answer = cancel(stack.operator, CeleryDispatch(stack.app), env.action_id, "ops@example.com", "changed mind")
        assert answer["accepted"] and answer["status_at_request"] == "verifying"
    finally:
        sor.set_read_outage(stack.sor_db, False, role="reader")
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.completed_verified,
                                                          "cancel_too_late")
    final = evidence_of(stack, env.action_id, "final_state")
    assert final[-1]["reason_code"] == "cancel_too_late"
    assert stack.events(env.action_id).count("tool_called") == 1
    assert stack.witness.count(key=env.idempotency_key) == 1
    assert stack.witness.cancels(key=env.idempotency_key) == []  # nothing was in flight to cancel
    assert stack.effects(env.idempotency_key) == 1


def test_later_step_delivered_early_is_ignored_and_runs_once_released(stack: Stack) -> None:
    first, second = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: ticket_env(stack, **kw)])
    # Step 0's message is lost by the broker: only the reconciler's re-drive (seconds later) can run
    # it, so step 1 is certainly still held back when its own message arrives out of turn.
    broker = LosingBroker()
    publish_message(stack.conn, broker, stack.message(first), first, settings=stack.settings)
    publish_message(stack.conn, broker, stack.message(second), second, settings=stack.settings, hold=True)
    assert stack.action(second.action_id).status == ActionStatus.pending
    stack.deliver(stack.message(second))
    wait_for(lambda: evidence_of(stack, second.action_id, "early_delivery_ignored"), 30,
             what="the early delivery to be recorded")
    early = evidence_of(stack, second.action_id, "early_delivery_ignored")[0]
    assert early["status"] == "pending"
    assert stack.witness.count(key=second.idempotency_key) == 0
    assert stack.effects(second.idempotency_key) == 0
    settled = run_settled(stack, first.run_id)
    assert settled["outcome"] == "completed", settled
    assert "redriven" in stack.events(first.action_id)
    assert stack.wait_settled(second.action_id).outcome == Outcome.completed_verified
    events = stack.events(second.action_id)
    assert events.count("tool_called") == 1
    assert events.index("early_delivery_ignored") < events.index("tool_called")
    assert [stack.witness.count(key=e.idempotency_key) for e in (first, second)] == [1, 1]
    assert [stack.effects(e.idempotency_key) for e in (first, second)] == [1, 1]
