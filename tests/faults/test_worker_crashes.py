"""A worker process killed (SIGKILL) at each stage of an action: before the request is sent,
after the response arrived but before the ledger write, after the ledger write but before the
broker ack, and in verification before its commit. Each time: at most one effect, a terminal
state reached by itself, and a ledger that was only ever appended to. On both brokers: Redis hands
the lost delivery back through Celery's requeue on worker loss, RabbitMQ through the channel's
unacknowledged message (its quorum queue counts the delivery)."""

from __future__ import annotations

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.contracts import contract_for
from proofline.ledger_check import check_chains
from proofline_kit.sor import store as sor
from tests.conftest import ON_EACH_BROKER, VERIFY_TASK, Stack, wait_for
from tests.helpers import new_account, refund_env
from worker.faultpoints import arm, fired


# With the verdict recorded in place, "before_verify_commit" kills the execute task after its
# verification read, before the one commit of result and verdict, and "after_ledger" after that
# commit; on the "verify-task" stack they are the verification task's and the result's own commit.
@pytest.mark.parametrize("stack", [*ON_EACH_BROKER, VERIFY_TASK], indirect=True)
@pytest.mark.parametrize("point", ["before_send", "after_send", "after_ledger", "before_verify_commit"])
def test_worker_killed_at_each_stage_leaves_exactly_one_effect(stack: Stack, point: str) -> None:
    account = new_account(stack)
    env = refund_env(stack, account)
    before = fired(stack.faultpoints, point)
    arm(stack.faultpoints, point, remaining=1)
    try:
        stack.publish(env)
        row = stack.wait_settled(env.action_id, timeout=90)
    finally:
        arm(stack.faultpoints, point, remaining=0)
    assert fired(stack.faultpoints, point) == before + 1, "the fault point must really have killed a worker"
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    # The downstream ignores idempotency keys: only the runtime kept this to one refund.
    assert stack.effects(env.idempotency_key) == 1
    assert len(sor.find_refund_by_key(stack.sor_db, env.idempotency_key)["refunds"]) == 1
    events = stack.events(env.action_id)
    if point in ("before_send", "after_send"):
        assert "reconcile_required" in events  # the next holder reconciled before anything else
    # A contract with independent evidence sources (refund.issue: the audit log) is always decided
    # by the verification task, inline verification or not.
    sources = contract_for(stack.settings.contracts_dir, env.action_type).verification.sources
    in_place = stack.env.get("PROOFLINE_INLINE_VERIFICATION") != "false" and not sources
    if point == "before_verify_commit":
        # Killed after reading: in place, nothing of the call was recorded and the next holder
        # reconciles; in the verification task, the result was and the task runs again.
        assert ("reconcile_required" in events) is in_place
    _, _, broken = check_chains(stack.conn)
    assert broken == []
    wait_for(stack.workers_alive, 10, what="Celery to replace the killed pool process")
