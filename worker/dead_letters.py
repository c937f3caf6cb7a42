"""Messages the broker dead-lettered (RabbitMQ), recorded in the ledger like the guard's own.

The message guard (``worker/guard.py``) moves a message that keeps ending its process to
``dead_letter`` after ``max_unsettled_deliveries``, with a ``dead_lettered`` record. A quorum queue
has its own limit (``x-delivery-limit``, higher: ``worker/broker.py``) for the deliveries the guard
could not count; what it dead-letters lands in :data:`~worker.broker.INBOX` with RabbitMQ's
``x-death`` header. This consumer step reads that queue in every worker's main process, records
each message on the same refusal chain and with the same event the guard uses (``by: broker``,
RabbitMQ's reason and count), marks its delivery count dead, and only then moves the message to
``dead_letter`` for operators. A message whose move failed is requeued and, on its next delivery,
found already recorded on its chain (``deliveries.dead_letter_recorded``): it is moved, not
recorded again. So every dead-lettered message has one record, whoever moved it, and
``dead_letter`` holds them all. While the ledger is away a message is not recorded: it stays
unacknowledged for ``dead_letter_retry_seconds`` (1 s) and is then requeued by the consumer's event
loop timer, which never waits for it (the worker's other consumers go on). The action itself stays
``published``: the reconciler re-sends it, or closes it past its deadline with the evidence
(``recovery/expiry.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps, signals
from kombu import Consumer

from ledger.refusals import record
from proofline.bounded import safe_str
from proofline.settings import get_settings
from worker import broker, deliveries, faultpoints, wire
from worker.guard import _body_of, _main, _settle_message, dead_letter_queue

log = logging.getLogger(__name__)

#: How many dead-lettered messages one worker takes at a time.
PREFETCH = 4


def death_of(headers: Any) -> dict[str, str]:
    """RabbitMQ's account of the dead-lettering (the first ``x-death`` entry): reason and queue, bounded."""
    headers = headers if isinstance(headers, dict) else {}
    deaths = headers.get("x-death")
    first = deaths[0] if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict) else {}
    reason = first.get("reason", headers.get("x-first-death-reason"))
    return {"reason": safe_str(str(reason), 40), "queue": safe_str(str(first.get("queue")), 200)}


def evidence_of(message: Any, body: bytes) -> tuple[str, dict[str, Any]]:
    """(message key, evidence) of a message the broker dead-lettered."""
    headers = message.headers if isinstance(message.headers, dict) else {}
    key = deliveries.message_key(headers.get("id"), body)
    try:
        action_id = deliveries.claimed_action_id(wire.loads(body))
    except Exception:  # noqa: BLE001 - a hostile body claims nothing
        action_id = None
    death = death_of(headers)
    return key, {
        "reason_code": "dead_lettered", "by": "broker", "broker_reason": death["reason"],
        "from_queue": death["queue"], "message_key": key,
        # Failed deliveries are the broker's limit plus the one that crossed it.
        "deliveries": get_settings().broker_delivery_limit + 1 if death["reason"] == "delivery_limit" else None,
        "queue": deliveries.DEAD_LETTER_QUEUE, "message_digest": wire.digest(body),
        "task": safe_str(str(headers.get("task")), 200), "claimed": {"action_id": action_id} if action_id else {},
    }


class DeadLetterRecorder(bootsteps.ConsumerStep):
    """Consumes :data:`~worker.broker.INBOX` in the worker's main process (AMQP brokers only)."""

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.app = parent.app
        self.parent = parent

    def include_if(self, parent: Any) -> bool:
        return broker.is_amqp(parent.app.conf.broker_url or "")

    def get_consumers(self, channel: Any) -> list[Consumer]:
        # on_message: the raw message, never decoded here (its body may be anything at all).
        consumer = Consumer(channel, queues=[self.app.amqp.queues[broker.INBOX]], on_message=self.on_message,
                            accept=[], no_ack=False)
        consumer.qos(prefetch_count=PREFETCH, apply_global=False)
        return [consumer]

    def on_message(self, message: Any) -> None:
        body = _body_of(message)
        key, evidence = evidence_of(message, body)
        chain = "refused:" + wire.digest(body)[:40]
        try:
            faultpoints.hit("before_dead_letter_record")
            # A message requeued after its record (its move failed) is not recorded twice.
            if not _main.run(deliveries.dead_letter_recorded, chain, key):
                _main.run(record, chain, "dead_lettered", get_settings().worker_id, evidence)
            _main.run(deliveries.mark_dead, key)  # again after a failed move: the latest dead-lettering
        except Exception as exc:  # noqa: BLE001 - the ledger is away: keep the message for later
            log.error("broker dead-letter not recorded; requeued", extra={"event": "dead_letter_unrecorded",
                                                                           "error": type(exc).__name__})
            self._requeue_later(message)
            return
        if not self._move(message, body):
            _settle_message(message, requeue=True)  # recorded; moved on a later delivery
            return
        log.error("message dead-lettered by the broker (%s)", evidence["broker_reason"],
                  extra={"event": "dead_lettered", "message_key": key,
                         "action_id": evidence["claimed"].get("action_id")})
        _settle_message(message)

    def _requeue_later(self, message: Any) -> None:
        """Requeue ``message`` after ``dead_letter_retry_seconds`` on the consumer's event loop timer,
        unacknowledged until then (it holds one of the :data:`PREFETCH` slots), so the loop never
        waits. Without an event loop (a pool that runs none) it is requeued at once, never slept on."""
        hub = getattr(self.parent, "hub", None)
        if hub is None:
            log.warning("no event loop to delay the requeue; requeued at once",
                        extra={"event": "dead_letter_requeued_now"})
            _settle_message(message, requeue=True)
            return
        hub.call_later(get_settings().dead_letter_retry_seconds, _settle_message, message, True)

    def _move(self, message: Any, body: bytes) -> bool:
        """To ``dead_letter``, where the guard's dead letters are, confirmed before the inbox's ack."""
        try:
            faultpoints.hit("before_dead_letter_move")
            with self.app.producer_or_acquire() as producer:
                producer.publish(body, exchange="", routing_key=deliveries.DEAD_LETTER_QUEUE,
                                 declare=[dead_letter_queue(self.app)], headers=message.headers,
                                 content_type=message.content_type, content_encoding=message.content_encoding,
                                 delivery_mode=2, retry=True, retry_policy={"max_retries": 3})
        except Exception as exc:  # noqa: BLE001 - it stays in the inbox until a move succeeds
            log.error("dead-letter move failed", extra={"event": "dead_letter_failed", "error": type(exc).__name__})
            return False
        return True


@signals.worker_init.connect
def _declare_topology(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        broker.declare_all(app)
    except Exception as exc:  # noqa: BLE001 - the consumer's own connection retries; it declares what it consumes
        log.error("broker topology not declared", extra={"event": "topology_undeclared", "error": type(exc).__name__})
