"""On RabbitMQ, actions merely queued behind a backlog are not re-driven.

One worker with one pool process on a RabbitMQ stack, every ticket creation made slow, and a burst
published at once: most of the burst waits in its shard far longer than the re-drive age. RabbitMQ
cannot be looked into without taking a message, so the worker's consumer writes how far it has
taken each queue (``worker/queue_marks.py``) and the reconciler leaves alone what was sent after
that while the shard still holds ready messages (``recovery/backlog.py``). Without the marks, every
action that waited past the re-drive age was re-sent (a copy each, opened and suppressed)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ledger import store
from ledger.states import ActionStatus, Outcome
from proofline.shards import queue_for_tenant
from proofline_kit.sor import store as sor
from tests.conftest import Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import ticket_env

BURST = 24
#: Each creation waits this long: the burst takes BURST times as long through the one pool process.
CALL_SECONDS = 0.6
REDRIVE_AFTER = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = build_stack("stdio", tmp_path_factory.mktemp("backlog-marks"), broker="rabbitmq",
                    extra_env={"PROOFLINE_REDRIVE_AFTER_SECONDS": str(REDRIVE_AFTER)})
    try:
        start_workers(s, count=1, concurrency=1)
        yield s
    finally:
        teardown_stack(s)


def test_a_burst_queued_behind_a_slow_pool_is_not_re_driven_on_rabbitmq(stack: Stack) -> None:
    envs = [ticket_env(stack) for _ in range(BURST)]
    sor.set_fault(stack.sor_db, "create_ticket", "delay", remaining=BURST, delay_seconds=CALL_SECONDS)
    try:
        for env in envs:
            stack.publish(env)

        def settled() -> list | None:
            now = [stack.action(e.action_id) for e in envs]
            return now if all(r.status in (ActionStatus.closed, ActionStatus.escalated) for r in now) else None

        rows = wait_for(settled, 240, interval=0.5, what=f"all {BURST} actions settled")
    finally:
        sor.clear_faults(stack.sor_db)
    assert all((r.status, r.outcome) == (ActionStatus.closed, Outcome.completed_verified) for r in rows)
    assert all(stack.effects(e.idempotency_key) == 1 for e in envs)
    # The burst really queued past the re-drive age: the last action started long after its publication.
    waited = [(r.updated_at - r.published_at).total_seconds() for r in rows]
    assert max(waited) > BURST * CALL_SECONDS / 2 > REDRIVE_AFTER, waited
    # The consumer marked the shard it took the burst from.
    with store.connect(stack.admin_url) as conn:  # the controller's role is not granted the marks
        marked = {row["queue"]: row["sent_at"] for row in conn.execute("SELECT queue, sent_at FROM queue_marks")}
    assert queue_for_tenant("acme", stack.settings.tenant_shards) in marked, marked
    # At most the tail is re-sent: once the shard holds nothing ready, a message prefetched by the
    # busy worker is indistinguishable from a lost one.
    redriven = sum(stack.events(e.action_id).count("redriven") for e in envs)
    assert redriven <= 3, redriven
