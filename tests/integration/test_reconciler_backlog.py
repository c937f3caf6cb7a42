"""The reconciler tells a backlog from a loss by the age of the oldest message waiting in a queue.

Published actions that no worker started are planted in a migrated database (triggers off: this
checks the sweep's decision, not the transitions before it). A real message waits in one tenant's
execute shard on a real Redis; nothing consumes it. Everything sent before it was taken already,
so an action last sent before that message is lost and re-driven; one sent after it may still wait
behind it and is left alone, until the shard drains. RabbitMQ cannot be looked into without taking
a message: there the consumers' marks of how far they took each queue stand in for the oldest
waiting message, for a queue that still holds ready messages. A broker that cannot be reached tells
nothing: there, nothing is left alone.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from celery import Celery

from ledger import store
from proofline.shards import queue_for_tenant
from recovery.reconciler import take
from tests.conftest import create_database, drop_database, free_port
from worker import queue_marks
from worker.dispatch import SENT_AT, CeleryDispatch, _sent_at

SHARDS = 8
PLANT = """
INSERT INTO actions (action_id, run_id, tenant, action_type, server, tool, idempotency_key, status, envelope,
                     deadline, updated_at, next_check_at, published_at)
VALUES (%(id)s, 'run-' || %(id)s, %(tenant)s, 'ticket.create', 'sor', 'create_ticket', 'k-' || %(id)s, 'published',
        '{}'::jsonb, now() + interval '1 hour', now() - interval '5 seconds', now() - interval '5 seconds',
        now() - make_interval(secs => %(age)s))
"""
BUSY = "acme"
QUIET = next(t for t in (f"tenant-{i}" for i in range(100))
             if queue_for_tenant(t, SHARDS) != queue_for_tenant(BUSY, SHARDS))


def plant(admin: str, **ages: tuple[str, float]) -> None:
    """Actions by id: (tenant, seconds since publication)."""
    with store.connect(admin) as conn, conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")  # the ledger's triggers off
        for action_id, (tenant, age) in ages.items():
            conn.execute(PLANT, {"id": action_id, "tenant": tenant, "age": age})


def sweep(admin: str, dispatch: CeleryDispatch) -> tuple[set[str], int]:
    with store.connect(admin) as conn, store.transaction(conn) as cur:
        taken = take(cur, "sweeper", stale_seconds=1.0, verify_stale_seconds=180.0, oldest=dispatch.oldest_waiting,
                     ready=dispatch.ready_counts, backlog_max_seconds=900.0, shards=SHARDS)
    return {row["action_id"] for row, _ in taken.redrives}, taken.counts["redrives_deferred_backlog"]


def redriven_events(admin: str) -> list[str]:
    with store.connect(admin) as conn:
        rows = conn.execute("SELECT action_id FROM ledger_events WHERE event = 'redriven' ORDER BY action_id")
        return [r["action_id"] for r in rows.fetchall()]


def test_a_message_behind_the_backlog_is_left_alone_and_a_lost_one_re_driven(broker_url: str) -> None:
    admin, _ = create_database("pl_backlog")
    # On RabbitMQ a publish returns once the broker took the message (publisher confirms, as the
    # product's own configuration has it; Redis ignores the option): without it, the count read next
    # on another connection may come before the message is in the queue (AMQP orders nothing across
    # connections).
    app = Celery(broker=broker_url, broker_transport_options={"confirm_publish": True})
    dispatch = CeleryDispatch(app, tenant_shards=SHARDS)
    busy_queue, quiet_queue = queue_for_tenant(BUSY, SHARDS), queue_for_tenant(QUIET, SHARDS)
    on_redis = broker_url.startswith("redis")
    try:
        plant(admin, **{"lost-before": (BUSY, 60), "too-old": (BUSY, 7200), "lost-elsewhere": (QUIET, 60)})
        taken_up_to = time.time()
        # Someone else's message now waits at the head of the busy shard; nothing consumes it.
        app.send_task("proofline.execute", args=[{}], queue=busy_queue)
        if not on_redis:
            # AMQP cannot be looked into without taking: what consumers took says how far each queue
            # was drained, as worker/queue_marks.py writes it (the quiet shard was drained entirely).
            with store.connect(admin) as conn:
                queue_marks.write(conn, "w-test", {busy_queue: taken_up_to, quiet_queue: taken_up_to})
        plant(admin, **{f"behind-{i}": (BUSY, 0) for i in range(3)})  # published after it was sent
        plant(admin, **{"late-elsewhere": (QUIET, 0)})  # published after the mark, on an empty shard: lost
        if on_redis:
            assert set(dispatch.oldest_waiting([busy_queue, quiet_queue])) == {busy_queue}
        else:
            assert dispatch.ready_counts([busy_queue, quiet_queue]) == {busy_queue: 1, quiet_queue: 0}
        first, deferred = sweep(admin, dispatch)
        assert (first, deferred) == ({"lost-before", "too-old", "lost-elsewhere", "late-elsewhere"}, 3)
        assert redriven_events(admin) == ["late-elsewhere", "lost-before", "lost-elsewhere", "too-old"]
        # The shard drains (here: purged, as if a worker took the message): the three were lost too.
        with app.connection_for_write() as broker:
            broker.default_channel.queue_purge(busy_queue)
        second, deferred = sweep(admin, dispatch)
        assert (second, deferred) == ({"behind-0", "behind-1", "behind-2"}, 0)
    finally:
        app.close()
        drop_database(admin)


@pytest.mark.parametrize("broker_url", ["rabbitmq"], indirect=True)  # Redis is looked into directly (above)
def test_without_marks_an_amqp_backlog_is_re_driven_as_before(broker_url: str) -> None:
    """No consumer took from the queue yet (or none writes marks): nothing is known, nothing left alone."""
    admin, _ = create_database("pl_backlog_nomarks")
    app = Celery(broker=broker_url, broker_transport_options={"confirm_publish": True})
    dispatch = CeleryDispatch(app, tenant_shards=SHARDS)
    try:
        app.send_task("proofline.execute", args=[{}], queue=queue_for_tenant(BUSY, SHARDS))
        plant(admin, **{f"behind-{i}": (BUSY, 0) for i in range(2)})
        assert sweep(admin, dispatch) == ({"behind-0", "behind-1"}, 0)
    finally:
        app.close()
        drop_database(admin)


def test_an_unreadable_broker_leaves_nothing_alone() -> None:
    admin, _ = create_database("pl_backlog_down")
    app = Celery(broker=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    app.conf.broker_connection_timeout = 1
    try:
        plant(admin, late=(BUSY, 0))
        assert sweep(admin, CeleryDispatch(app, tenant_shards=SHARDS)) == ({"late"}, 0)
    finally:
        app.close()
        drop_database(admin)


def test_only_a_well_formed_send_time_counts() -> None:
    def raw(headers: Any) -> bytes:
        return json.dumps({"headers": headers, "body": ""}).encode()

    assert _sent_at(raw({SENT_AT: 1700000000.5})) == 1700000000.5
    for hostile in (None, b"", b"not json", raw({}), raw({SENT_AT: "1700000000"}), raw({SENT_AT: True}),
                    raw([SENT_AT]), b"[1, 2]"):
        assert _sent_at(hostile) is None, hostile
