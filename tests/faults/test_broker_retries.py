"""A delivery retried with a countdown comes back through the broker, on both brokers.

Redis holds a countdown message in the worker until it is due; RabbitMQ's quorum queues cannot
(a running consumer's prefetch cannot grow), so it travels through Celery's delayed-delivery queues
and must be routed back to the queue it came from. The second of two actions on one target waits
for the first's lock (``target_busy``), is retried after its backoff, and then runs."""

from __future__ import annotations

import pytest

from ledger.states import ActionStatus, Outcome
from tests.conftest import ON_EACH_BROKER, Stack, wait_for
from tests.containment.helpers import worker_log
from tests.helpers import ticket_env
from worker import faultpoints


@pytest.mark.parametrize("stack", ON_EACH_BROKER, indirect=True)
def test_a_busy_target_retry_comes_back_through_the_broker(stack: Stack) -> None:
    first, second = ticket_env(stack), ticket_env(stack)  # the same ticket queue: one target
    faultpoints.arm(stack.faultpoints, "before_send", remaining=1, action="hold", seconds=30)
    try:
        stack.publish(first)
        stack.wait_event(first.action_id, "preconditions_passed")  # it holds the target lock now
        task_id = stack.publish(second)["task_id"]
        stack.wait_event(second.action_id, "target_busy", timeout=30)
    finally:
        faultpoints.release(stack.faultpoints, "before_send")
    rows = [stack.wait_settled(e.action_id, timeout=60) for e in (first, second)]
    assert all((r.status, r.outcome) == (ActionStatus.closed, Outcome.completed_verified) for r in rows)
    assert [stack.effects(e.idempotency_key) for e in (first, second)] == [1, 1]

    # A retry keeps its task id: the same task came back from the broker after its countdown. (A
    # first delivery of a message is not counted in message_deliveries, so the worker's log is the
    # record: Celery logs each receipt, and the retry it scheduled.)
    def receipts() -> int:
        return worker_log(stack).count(f"Task proofline.execute[{task_id}] received")

    wait_for(lambda: receipts() >= 2, 10, what="the retried task to be received again")
    assert f"Task proofline.execute[{task_id}] retry" in worker_log(stack)
