"""What the broker is asked to guarantee, per kind of broker: the Celery options that differ.

Redis (``redis://``) keeps an unacknowledged message in a per-consumer hash and hands it back when
the visibility timeout passes; it has no delivery limit, and a crash without persistence loses
every queued message (the reconciler re-drives them from the ledger).

RabbitMQ (``amqp://``, ``amqps://``, ``pyamqp://``) gets:

- **quorum queues** (``x-queue-type: quorum``, Raft-replicated, always durable) for every queue,
  with persistent messages, so a broker restart loses nothing it had confirmed;
- **publisher confirms** (``confirm_publish``): a publish returns only once the broker has taken
  the message, so a controller never records ``published`` for a message the broker dropped;
- a **cluster** is a ``;``-separated URL list: a connection that drops (its node died) is opened
  again on the next node of the list, and a publish that failed on the way is sent again there
  (:func:`publish_retry`), so a node lost mid-publish costs a resend, never the message. A resend
  may duplicate a message the dead node had taken: the idempotency claim suppresses the copy;
- a **delivery limit** (``x-delivery-limit``, ``Settings.broker_delivery_limit``) with a
  **dead-letter exchange**: a message returned that many times without an acknowledgement goes
  to :data:`INBOX`, where the consumer records it (``worker/dead_letters.py``) and moves it on to
  ``dead_letter``. The message guard (``worker/deliveries.py``) dead-letters after fewer failed
  deliveries, with its count in Postgres; the broker's limit only acts on deliveries the guard
  could not count (Postgres away, a refusal it could not record);
- per-consumer prefetch (quorum queues refuse a channel-wide one: ``worker_detect_quorum_queues``);
- one topic exchange, :data:`EXCHANGE`, because Celery's native delayed delivery (how a
  ``countdown`` works without holding the message in the worker: quorum queues cannot raise a
  running consumer's prefetch) does not route through direct exchanges. A retry with a countdown
  goes back to the queue it came from (:func:`route`), not to the task's default queue.
"""

from __future__ import annotations

import math
import re
from typing import Any

from kombu import Exchange, Queue

from proofline.settings import Settings
from proofline.shards import BASE_QUEUE, VERIFY_QUEUE, sharded_queues
from worker.deliveries import DEAD_LETTER_QUEUE

AMQP_SCHEMES = ("amqp://", "amqps://", "pyamqp://")
#: Every Proofline queue is bound to this exchange under its own name.
EXCHANGE = "proofline"
#: Where the broker dead-letters a message past its delivery limit; the consumer records each one
#: in the ledger, then moves it to ``dead_letter`` (``worker/dead_letters.py``).
INBOX = "dead_letter.broker"
#: Queues whose messages are work for an action: poison there is dead-lettered and recorded.
#: A sweep (reconcile, checkpoint) past the limit is dropped: beat sends the next one anyway.
SWEEP_QUEUES = ("reconcile", "checkpoint")
FIXED_QUEUES = ("compensate", "recovery", *SWEEP_QUEUES)
#: How a publish that met a dropped connection is retried (kombu's ``ensure``): the first retry at
#: once on the next node of the URL list, then every half second (:func:`publish_retry`).
PUBLISH_RETRY = {"interval_start": 0, "interval_step": 0.25, "interval_max": 0.5}
#: Native delayed delivery prefixes the routing key with 28 binary digits (kombu 5.5+).
_DELAY_PREFIX = re.compile(r"^(?:[01]\.){28}")


def whole_seconds(countdown: Any) -> Any:
    """A countdown rounded up to whole seconds. Celery's native delayed delivery (RabbitMQ) truncates
    a countdown to an int and fails on a zero after a positive one (kombu's ``calculate_routing_key``):
    0.5 s would raise inside ``send_task``. Rounding up costs less than a second on any broker."""
    if isinstance(countdown, int | float) and countdown > 0:
        return math.ceil(countdown)
    return countdown


def publish_retry(seconds: float) -> dict[str, Any]:
    """kombu's retry policy for a publish that keeps trying for about ``seconds``
    (``broker_publish_retry_seconds``): RabbitMQ elects a new quorum-queue leader within a second on
    a quiet machine, and took longer than ten seconds under load (the publish then timed out)."""
    return {"max_retries": 1 + math.ceil(seconds / PUBLISH_RETRY["interval_max"]), **PUBLISH_RETRY}


def is_amqp(url: str) -> bool:
    return url.startswith(AMQP_SCHEMES)


def work_queue_names(tenant_shards: int) -> list[str]:
    """Every queue a task is sent to: both sharded queues, all their shards, then the fixed ones."""
    return [*sharded_queues(BASE_QUEUE, tenant_shards), *sharded_queues(VERIFY_QUEUE, tenant_shards), *FIXED_QUEUES]


def quorum_queues(settings: Settings) -> list[Queue]:
    """The declarations every process on an AMQP broker must share: RabbitMQ refuses to redeclare a
    queue with other arguments (``PRECONDITION_FAILED``), so publishers use these too."""
    exchange = Exchange(EXCHANGE, type="topic", durable=True)
    base: dict[str, Any] = {"x-queue-type": "quorum"}
    if settings.broker_quorum_group_size is not None:
        base["x-quorum-initial-group-size"] = settings.broker_quorum_group_size
    dead_lettering = {
        "x-delivery-limit": settings.broker_delivery_limit,
        "x-dead-letter-exchange": EXCHANGE, "x-dead-letter-routing-key": INBOX,
        # Dead-lettering confirmed by the target queue, so a poison message is never lost on the way;
        # RabbitMQ requires reject-publish overflow for it (no length limit is set, so it never applies).
        "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish",
    }
    queues = []
    for name in work_queue_names(settings.tenant_shards):
        arguments = {**base, "x-delivery-limit": settings.broker_delivery_limit} if name in SWEEP_QUEUES \
            else {**base, **dead_lettering}
        queues.append(Queue(name, exchange, routing_key=name, durable=True, queue_arguments=arguments))
    # Kept for operators, consumed by nobody: no limit, no further dead-lettering.
    for name in (INBOX, DEAD_LETTER_QUEUE):
        queues.append(Queue(name, exchange, routing_key=name, durable=True, queue_arguments=dict(base)))
    return queues


def queue_of(routing_key: Any) -> str | None:
    """The queue a delivered message came from, from its routing key (a delayed delivery's carries
    the delay prefix); None when it names none of ours."""
    if not isinstance(routing_key, str):
        return None
    return _DELAY_PREFIX.sub("", routing_key, count=1) or None


def retry_router(settings: Settings) -> Any:
    """A Celery router (AMQP only): a retry goes back to the queue its message came from. Celery's
    delayed delivery routes by the *queue's* routing key, and without this the task's default route
    (``actions``, shard 0) would win over the tenant's shard the message was on."""
    known = set(work_queue_names(settings.tenant_shards))

    def route(name: str, args: Any, kwargs: Any, options: dict[str, Any], task: Any = None, **_: Any) -> Any:
        queue = queue_of(options.get("routing_key"))
        if name.startswith("proofline.") and queue in known:
            return {"queue": queue}
        return None

    return route


def celery_options(settings: Settings, url: str) -> dict[str, Any]:
    """The broker-specific part of the Celery configuration, for workers and publishers alike."""
    if url.startswith("sqla+"):
        # kombu's SQLAlchemy transport (the embedded default) hands its options to create_engine and
        # has no visibility timeout: an unacknowledged message stays with its consumer.
        return {"broker_transport_options": {"pool_pre_ping": True}, "broker_pool_limit": 2}
    if not is_amqp(url):
        # Redis: longer than the longest absolute deadline, so Redis never hands a running task to
        # a second worker; deadlines themselves live in Postgres, never in broker ETAs.
        return {"broker_transport_options": {"visibility_timeout": settings.visibility_timeout}}
    return {
        "broker_transport_options": {"confirm_publish": True},
        "task_publish_retry_policy": publish_retry(settings.broker_publish_retry_seconds),
        "task_queues": quorum_queues(settings),
        "task_create_missing_queues": False,
        "task_default_exchange": EXCHANGE,
        "task_default_exchange_type": "topic",
        "task_default_delivery_mode": "persistent",
        "worker_detect_quorum_queues": True,
        "broker_native_delayed_delivery_queue_type": "quorum",
    }


def task_routes(settings: Settings, url: str, static: dict[str, Any]) -> Any:
    """``task_routes``: the static routes, behind the retry router on an AMQP broker."""
    return [retry_router(settings), static] if is_amqp(url) else static


def declare_all(app: Any) -> None:
    """Declare every queue of the topology (AMQP only), before the consumer starts: Celery's delayed
    delivery binds every configured queue, not only the consumed ones, and the dead-letter inbox must
    exist before the broker routes anything to it."""
    if not is_amqp(app.conf.broker_url or ""):
        return
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=5)
        channel = conn.channel()
        try:
            for queue in app.amqp.queues.values():
                queue(channel).declare()
        finally:
            channel.close()
