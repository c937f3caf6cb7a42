"""A verification whose reads were overtaken: two verifications of one attempt (a redelivered or
re-driven verify task, as a worker killed mid-stage leaves), the first held just before its
commit while the second decides "absent", recovery retries, and the retry's result brings the row
back to ``verifying``. The held one then holds a finding about the attempt before. The row is
``verifying`` again, so a guard on the status alone let it through: it handed a completed action
to recovery, which found the row and its signed evidence apart and escalated it. It must be
superseded, and the retry's own verification must decide.
"""

from __future__ import annotations

from ledger.states import ActionStatus, Outcome
from proofline_kit.sor import store as sor
from tests.conftest import Stack, wait_for
from tests.helpers import new_account, refund_env
from worker.dispatch import CeleryDispatch
from worker.faultpoints import arm, fired, release


def test_a_verification_overtaken_by_a_retry_is_superseded_not_applied(stack: Stack) -> None:
    account = new_account(stack)
    env = refund_env(stack, account)
    points = stack.faultpoints
    held, retried = fired(points, "before_verify_commit"), fired(points, "after_ledger")
    # The first attempt's write says "done" and does nothing: its verifications find the effect absent.
    sor.set_fault(stack.sor_db, "issue_refund", "lie", remaining=1)
    arm(points, "before_verify_commit", remaining=1, action="hold", seconds=120, action_id=env.action_id)
    try:
        stack.publish(env)
        wait_for(lambda: fired(points, "before_verify_commit") == held + 1, 90,
                 what="the first verification to read and wait at its commit")
        # Whatever the first attempt's execute does at after_ledger is done: only the retry's stops there.
        arm(points, "after_ledger", remaining=1, action="hold", seconds=120, action_id=env.action_id)
        CeleryDispatch(stack.app).verify(env.action_id, env.tenant)  # a second delivery of the verification
        wait_for(lambda: fired(points, "after_ledger") == retried + 1, 120,
                 what="the retry to record its result (the row verifying again) and wait before its verification")
        assert stack.action(env.action_id).status == ActionStatus.verifying
        release(points, "before_verify_commit")
        # Superseded, or (the defect) applied: a second hand-over to recovery, or an escalation.
        wait_for(lambda: (lambda ev: "verification_superseded" in ev or ev.count("handed_to_recovery") > 1
                          or "escalated" in ev)(stack.events(env.action_id)), 90,
                 what="the held verification to end")
        assert "verification_superseded" in stack.events(env.action_id), stack.story(env.action_id)
    finally:
        release(points, "before_verify_commit")
        release(points, "after_ledger")
        sor.clear_faults(stack.sor_db)
    row = stack.wait_settled(env.action_id, timeout=120)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), stack.story(env.action_id)
    events = stack.events(env.action_id)
    assert events.count("handed_to_recovery") == 1 and "escalated" not in events, events
    assert len(sor.find_refund_by_key(stack.sor_db, env.idempotency_key)["refunds"]) == 1
    superseded = [e["evidence"] for e in stack.timeline(env.action_id) if e["event"] == "verification_superseded"]
    assert [e["superseded"] for e in superseded] == ["later_verdict"], superseded
