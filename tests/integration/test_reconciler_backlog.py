"""The reconciler tells a backlog from a loss by the broker's queue depth, on both brokers.

Published actions whose worker never started them are planted in a migrated database (triggers
off: this checks the sweep's decision, not the transitions before it). A real message waits in
one tenant's execute shard on a real Redis or RabbitMQ; nothing consumes it. The actions on that
shard are late, not lost, and are left alone; those on an empty shard, and one older than the
backlog bound, are re-driven. Once the shard is drained, the others are re-driven too. A broker
that cannot be reached defers nothing.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from ledger import store
from proofline.shards import queue_for_tenant
from recovery.reconciler import take
from tests.conftest import create_database, drop_database, free_port
from worker.dispatch import CeleryDispatch

SHARDS = 8
PLANT = """
INSERT INTO actions (action_id, run_id, tenant, action_type, server, tool, idempotency_key, status, envelope,
                     deadline, updated_at, next_check_at, published_at)
VALUES (%(id)s, 'run-' || %(id)s, %(tenant)s, 'ticket.create', 'sor', 'create_ticket', 'k-' || %(id)s, 'published',
        '{}'::jsonb, now() + interval '1 hour', now() - make_interval(secs => %(age)s),
        now() - make_interval(secs => %(age)s), now() - make_interval(secs => %(age)s))
"""


def other_shard_tenant(tenant: str) -> str:
    return next(t for t in (f"tenant-{i}" for i in range(100))
                if queue_for_tenant(t, SHARDS) != queue_for_tenant(tenant, SHARDS))


def claimed(cur: Any, dispatch: CeleryDispatch) -> tuple[set[str], int]:
    taken = take(cur, "sweeper", stale_seconds=1.0, verify_stale_seconds=180.0, depths=dispatch.queue_depths,
                 backlog_max_seconds=900.0, shards=SHARDS)
    return {row["action_id"] for row, _ in taken.redrives}, taken.counts["redrives_deferred_backlog"]


def test_a_backlog_is_left_alone_and_a_loss_re_driven(broker_url: str) -> None:
    busy, quiet = "acme", other_shard_tenant("acme")
    admin, _ = create_database("pl_backlog")
    app = Celery(broker=broker_url)
    dispatch = CeleryDispatch(app, tenant_shards=SHARDS)
    try:
        with store.connect(admin) as conn:
            with conn.transaction():
                conn.execute("SET LOCAL session_replication_role = replica")  # the ledger's triggers off
                for i in range(3):
                    conn.execute(PLANT, {"id": f"late-{i}", "tenant": busy, "age": 120})
                conn.execute(PLANT, {"id": "lost", "tenant": quiet, "age": 120})
                conn.execute(PLANT, {"id": "too-old", "tenant": busy, "age": 3600})
            # Someone else's message waits in the busy tenant's shard; no worker consumes it.
            app.send_task("proofline.execute", args=[{}], queue=queue_for_tenant(busy, SHARDS))
            assert dispatch.queue_depths([queue_for_tenant(busy, SHARDS)]) == {queue_for_tenant(busy, SHARDS): 1}

            with store.transaction(conn) as cur:
                first, deferred = claimed(cur, dispatch)
            assert (first, deferred) == ({"lost", "too-old"}, 3)
            events = conn.execute("SELECT action_id FROM ledger_events WHERE event = 'redriven'").fetchall()
            assert sorted(e["action_id"] for e in events) == ["lost", "too-old"]

            # The shard drains (here: purged, as if the worker took the message): the three are lost now.
            with app.connection_for_write() as broker:
                broker.default_channel.queue_purge(queue_for_tenant(busy, SHARDS))
            with store.transaction(conn) as cur:
                second, deferred = claimed(cur, dispatch)
            assert (second, deferred) == ({"late-0", "late-1", "late-2"}, 0)
    finally:
        app.close()
        drop_database(admin)


def test_an_unreadable_broker_defers_nothing() -> None:
    admin, _ = create_database("pl_backlog_down")
    app = Celery(broker=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    app.conf.broker_connection_timeout = 1
    try:
        with store.connect(admin) as conn:
            with conn.transaction():
                conn.execute("SET LOCAL session_replication_role = replica")
                conn.execute(PLANT, {"id": "late", "tenant": "acme", "age": 120})
            with store.transaction(conn) as cur:
                found, deferred = claimed(cur, CeleryDispatch(app, tenant_shards=SHARDS))
        assert (found, deferred) == ({"late"}, 0)
    finally:
        app.close()
        drop_database(admin)
