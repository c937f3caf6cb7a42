"""The broker-specific Celery options (worker/broker.py): pure logic, no broker."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from proofline.settings import Settings
from proofline.shards import queue_name
from worker import broker
from worker.deliveries import DEAD_LETTER_QUEUE

AMQP = "amqp://guest:guest@127.0.0.1:5672//"


def settings(**kw: object) -> Settings:
    return Settings(broker_url=AMQP, tenant_shards=4, **kw)


def test_every_work_queue_is_a_quorum_queue_with_the_limit_and_the_dead_letter_exchange() -> None:
    queues = {q.name: q for q in broker.quorum_queues(settings(broker_delivery_limit=7))}
    assert set(queues) == {*broker.work_queue_names(4), broker.INBOX, DEAD_LETTER_QUEUE}
    assert {queue_name(i) for i in range(4)} | {queue_name(i, "verify") for i in range(4)} <= set(queues)
    for name, queue in queues.items():
        args = queue.queue_arguments
        assert args["x-queue-type"] == "quorum" and queue.durable, name
        assert queue.exchange.name == broker.EXCHANGE and queue.exchange.type == "topic" and queue.routing_key == name
        if name in (broker.INBOX, DEAD_LETTER_QUEUE):
            assert set(args) == {"x-queue-type"}, name  # kept for operators: no limit, no onward dead-lettering
        elif name in broker.SWEEP_QUEUES:
            assert args["x-delivery-limit"] == 7 and "x-dead-letter-exchange" not in args, name
        else:
            assert (args["x-delivery-limit"], args["x-dead-letter-exchange"], args["x-dead-letter-routing-key"]) \
                == (7, broker.EXCHANGE, broker.INBOX), name
            assert (args["x-dead-letter-strategy"], args["x-overflow"]) == ("at-least-once", "reject-publish")


def test_the_replica_count_is_declared_only_when_set() -> None:
    """An existing queue was declared without ``x-quorum-initial-group-size``, and RabbitMQ refuses a
    redeclaration that adds it: unset, nothing changes; set, every queue names it."""
    assert all("x-quorum-initial-group-size" not in q.queue_arguments for q in broker.quorum_queues(settings()))
    queues = broker.quorum_queues(settings(broker_quorum_group_size=3))
    assert {q.queue_arguments["x-quorum-initial-group-size"] for q in queues} == {3}
    with pytest.raises(ValidationError):
        settings(broker_quorum_group_size=0)


def test_options_per_broker() -> None:
    amqp = broker.celery_options(settings(), AMQP)
    assert amqp["broker_transport_options"] == {"confirm_publish": True}
    # A publish that met a dead node is sent again, the first time at once (on the next node).
    policy = amqp["task_publish_retry_policy"]
    assert policy["interval_start"] == 0 and policy["max_retries"] * policy["interval_max"] >= 5
    assert amqp["task_default_delivery_mode"] == "persistent" and amqp["worker_detect_quorum_queues"] is True
    assert amqp["task_create_missing_queues"] is False
    redis = broker.celery_options(settings(), "redis://127.0.0.1:6379/0")
    assert redis == {"broker_transport_options": {"visibility_timeout": settings().visibility_timeout}}
    assert "task_queues" not in broker.celery_options(settings(), "sqla+postgresql+psycopg://x/y")


def test_the_delivery_limit_must_stay_behind_the_guard() -> None:
    with pytest.raises(ValidationError, match="must exceed"):
        settings(max_unsettled_deliveries=5, broker_delivery_limit=5)
    assert settings(max_unsettled_deliveries=5, broker_delivery_limit=6).broker_delivery_limit == 6


def test_a_retry_goes_back_to_the_queue_it_came_from() -> None:
    route = broker.retry_router(settings())
    delayed = "0." * 27 + "1.actions.3"
    assert route("proofline.execute", [], {}, {"routing_key": delayed}) == {"queue": "actions.3"}
    assert route("proofline.verify", [], {}, {"routing_key": "verify.2"}) == {"queue": "verify.2"}
    # Not ours, no routing key, or a queue we do not have: the static routes decide.
    assert route("celery.chain", [], {}, {"routing_key": "actions"}) is None
    assert route("proofline.execute", [], {}, {}) is None
    assert route("proofline.execute", [], {}, {"routing_key": "actions.99"}) is None


@pytest.mark.parametrize("given, sent", [(0.5, 1), (1.0, 1), (2.2, 3), (0, 0), (None, None), (-1, -1)])
def test_countdowns_are_whole_seconds(given: object, sent: object) -> None:
    assert broker.whole_seconds(given) == sent


def test_what_rabbitmq_says_about_a_dead_letter_is_read_defensively() -> None:
    from worker.dead_letters import death_of

    said = {"x-death": [{"count": 1, "reason": "delivery_limit", "queue": "actions.3"}],
            "x-first-death-reason": "delivery_limit"}
    assert death_of(said) == {"reason": "delivery_limit", "queue": "actions.3"}
    assert death_of({"x-first-death-reason": "rejected", "x-death": "not a list"})["reason"] == "rejected"
    assert death_of(None) == {"reason": "None", "queue": "None"}
    assert len(death_of({"x-death": [{"reason": "x" * 1000}]})["reason"]) <= 40


def test_delayed_delivery_is_declared_on_the_node_the_consumer_reached_first() -> None:
    """A cluster's list with its head dead: the node the consumer just connected to goes first."""
    from kombu import Connection

    from worker.delayed_delivery import _live_first

    nodes = [f"amqp://pl:pw@127.0.0.1:{port}//" for port in (5001, 5002, 5003)]
    assert _live_first(nodes, Connection(nodes[1])) == [nodes[1], nodes[0], nodes[2]]
    assert _live_first(nodes, None) == nodes  # no connection to go by: the list's order
    assert _live_first(nodes, Connection("amqp://pl:pw@10.0.0.9:5001//")) == nodes
