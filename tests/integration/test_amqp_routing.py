"""On RabbitMQ, a retry with a countdown travels through Celery's delayed-delivery queues and must
land back on the tenant shard it came from, not on the task's default queue (real broker, a fresh
virtual host, no worker consuming)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from kombu import Connection
from kombu.transport.native_delayed_delivery import (
    bind_queue_to_native_delayed_delivery_exchange,
    declare_native_delayed_delivery_exchanges_and_queues,
)

from proofline.settings import Settings
from proofline_kit.processes import wait_for
from proofline_kit.resources import RabbitVhost, create_vhost, delete_vhost
from worker import broker, wire


@pytest.fixture
def vhost() -> Iterator[RabbitVhost]:
    made = create_vhost()
    try:
        yield made
    finally:
        delete_vhost(made)


def waiting(url: str, queue: str) -> int:
    with Connection(url) as conn:
        return int(conn.channel().queue_declare(queue, passive=True).message_count)


@pytest.mark.parametrize("router", [True, False], ids=["retry-router", "static-routes-only"])
def test_a_delayed_retry_returns_to_its_shard(vhost: RabbitVhost, router: bool) -> None:
    settings = Settings(broker_url=vhost.url, tenant_shards=4)
    app = Celery("routing-test", broker=vhost.url)
    app.conf.update(broker.celery_options(settings, vhost.url))
    static = {"proofline.execute": {"queue": "actions"}}
    app.conf.task_routes = broker.task_routes(settings, vhost.url, static) if router else static
    broker.declare_all(app)
    with Connection(vhost.url) as conn:  # what a worker's delayed-delivery step sets up when it starts
        declare_native_delayed_delivery_exchanges_and_queues(conn, "quorum")
        for queue in app.amqp.queues.values():
            bind_queue_to_native_delayed_delivery_exchange(conn, queue)
    # A retry's options: Celery copies the delivery's exchange and routing key (signature_from_request).
    app.send_task("proofline.execute", args=[{"envelope": {}}], serializer=wire.NAME, countdown=1,
                  exchange=broker.EXCHANGE, routing_key="actions.3")
    arrived = wait_for(lambda: waiting(vhost.url, "actions.3") + waiting(vhost.url, "actions"), 30,
                       what="the delayed message to arrive")
    assert arrived == 1
    # Without the retry router, Celery's delayed delivery uses the default route's queue: shard 0.
    assert (waiting(vhost.url, "actions.3"), waiting(vhost.url, "actions")) == ((1, 0) if router else (0, 1))
