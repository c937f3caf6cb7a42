"""The message guard inside the Celery consumer (the worker's main process).

Celery drops messages it cannot use: an unaccepted content type, an undecodable body, an unknown
task, an invalid header is logged and rejected, and never reaches the ledger. Anything that raises
past those handlers (a body that is not ``(args, kwargs, embed)``, a header pickle cannot carry)
ends the consumer, and Redis hands the same message back to the restarted worker. This consumer
records every such message as ``envelope_refused`` on its own ``refused:<digest>`` chain and
acknowledges it; it counts deliveries per message and moves one that keeps killing its pool
process to the ``dead_letter`` queue (``worker/deliveries.py``).
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from celery.worker.consumer import Consumer
from kombu import Queue
from kombu.exceptions import ContentDisallowed

from ledger import store
from ledger.refusals import record
from proofline.bounded import safe_repr, safe_str
from proofline.settings import get_settings, reveal
from worker import deliveries, faultpoints, queue_marks, wire
from worker.broker import is_amqp, queue_of
from worker.dispatch import SENT_AT

log = logging.getLogger(__name__)

#: Only these tasks are run for a message.
TASK_PREFIX = "proofline."
#: Headers nest a level or two; a deeper one cannot be pickled safely for the pool.
MAX_HEADER_DEPTH = 16


class _MainConnection:
    """One Postgres connection for the consumer process, reopened when it breaks. psycopg never
    closes a connection inherited across fork, so pool processes cannot disturb it."""

    conn: psycopg.Connection | None = None

    def get(self) -> psycopg.Connection:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.conn = store.connect(reveal(get_settings().database_url), application_name="proofline-consumer",
                                      connect_timeout=10)
        return self.conn

    def run(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(self.get(), *args)
        except psycopg.OperationalError:
            self.conn = None
            return fn(self.get(), *args)


_main = _MainConnection()


def header_depth(value: Any, limit: int = MAX_HEADER_DEPTH) -> int:
    """Nesting depth of decoded headers, by an explicit stack (never recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _body_of(message: Any) -> bytes:
    body = getattr(message, "body", b"")
    if isinstance(body, str):
        return body.encode("utf-8", "surrogatepass")
    return bytes(body) if isinstance(body, bytes | bytearray | memoryview) else safe_repr(body).encode()


def _eta_too_far(eta: Any) -> bool:
    if eta is None:
        return False
    try:
        when = datetime.fromisoformat(eta) if isinstance(eta, str) else None
    except ValueError:
        return False  # Celery refuses an unparseable ETA itself (recorded by on_invalid_task)
    if when is None:
        return False
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when > datetime.now(UTC) + timedelta(seconds=get_settings().max_deadline_seconds)


def _text(value: Any) -> str:
    return safe_str(value, 200) if isinstance(value, str) else safe_repr(value, 200)


def refuse_message(message: Any, reason: str, detail: str, worker_id: str) -> None:
    """Record an unusable message on its refusal chain, then acknowledge it. If the ledger cannot
    be written, the message goes back to the queue (after a pause) rather than being lost."""
    body = _body_of(message)
    headers = getattr(message, "headers", None)
    evidence = {
        "reason_code": reason, "detail": detail, "message_digest": wire.digest(body), "message_bytes": len(body),
        "excerpt": wire.excerpt(body), "content_type": safe_str(str(getattr(message, "content_type", None)), 100),
        "task": _text(headers.get("task")) if isinstance(headers, dict) else None,
        "task_id": _text(headers.get("id")) if isinstance(headers, dict) else None,
        "by": "consumer",
    }
    chain = "refused:" + wire.digest(body)[:40]
    try:
        _main.run(record, chain, "envelope_refused", worker_id, evidence)
    except Exception as exc:  # noqa: BLE001 - the ledger is unreachable: keep the message
        log.error("refusal could not be recorded; message requeued",
                  extra={"event": "refusal_unrecorded", "error": type(exc).__name__, "reason_code": reason})
        time.sleep(1.0)
        _settle_message(message, requeue=True)
        return
    log.warning("message refused by the guard", extra={"event": "envelope_refused", "reason_code": reason,
                                                        "chain": chain})
    _settle_message(message)


def _settle_message(message: Any, requeue: bool = False) -> None:
    try:
        if not message.acknowledged:
            message.reject(requeue=True) if requeue else message.ack()
    except Exception as exc:  # noqa: BLE001 - a lost channel: the broker will redeliver it
        log.warning("could not settle a refused message", extra={"error": type(exc).__name__})


def dead_letter_queue(app: Any) -> Queue:
    """The ``dead_letter`` queue as this app declares it (a quorum queue on RabbitMQ: a declaration
    with other arguments would be refused), else a plain durable one."""
    queues = app.amqp.queues
    name = deliveries.DEAD_LETTER_QUEUE
    return queues[name] if name in queues else Queue(name, durable=True)


class GuardedConsumer(Consumer):
    """Celery's consumer with every rejection path recorded and no message able to end it."""

    class Blueprint(Consumer.Blueprint):
        # Delayed delivery declared once per cluster, not once per node URL (worker/delayed_delivery.py).
        default_steps = ["worker.delayed_delivery:ClusterDelayedDelivery" if step.endswith(":DelayedDelivery")
                         else step for step in Consumer.Blueprint.default_steps]

    def create_task_handler(self, promise: Any = None) -> Any:
        inner = super().create_task_handler() if promise is None else super().create_task_handler(promise)
        worker_id = get_settings().worker_id
        # Where a queue cannot be looked into (AMQP), how far it was taken tells a backlog from a loss.
        marks = queue_marks.Marks(worker_id, _main.run) if is_amqp(reveal(get_settings().broker_url)) else None

        def on_task_received(message: Any) -> None:
            try:
                if self._admit(message, worker_id):
                    if marks is not None:
                        marks.taken(queue_of(message.delivery_info.get("routing_key")),
                                    message.headers.get(SENT_AT))
                    return inner(message)
            except Exception as exc:  # noqa: BLE001 - no message may end the consumer
                refuse_message(message, "message_malformed", f"message could not be processed: "
                               f"{type(exc).__name__}: {safe_repr(exc, 200)}", worker_id)
            return None

        return on_task_received

    def _admit(self, message: Any, worker_id: str) -> bool:
        """Header checks and the delivery count; False when the message was dealt with here."""
        headers = message.headers
        if not isinstance(headers, dict) or header_depth(headers) > MAX_HEADER_DEPTH:
            refuse_message(message, "message_malformed", "headers are not a flat mapping", worker_id)
            return False
        # Time limits come from this worker's configuration, never from a message.
        headers.pop("timelimit", None)
        task_name = headers.get("task")
        if not isinstance(task_name, str) or task_name not in self.app.tasks:
            return True  # Celery's own unknown-message / unknown-task paths record it (below)
        if not task_name.startswith(TASK_PREFIX):
            # Celery's built-in canvas tasks (celery.group, celery.chain, ...) are registered in
            # every worker and would start other tasks on a stranger's behalf.
            refuse_message(message, "message_unknown_task", "not a Proofline task", worker_id)
            return False
        if _eta_too_far(headers.get("eta")):
            # An ETA is held in the worker's memory until it is due: our own are short retry
            # backoffs, never beyond the longest deadline.
            refuse_message(message, "message_malformed", "eta beyond the longest deadline", worker_id)
            return False
        task_id = headers.get("id")
        if not (isinstance(task_id, str) and 0 < len(task_id) <= 200 and task_id.isprintable()):
            refuse_message(message, "message_malformed", "task id missing or not a short printable string",
                           worker_id)
            return False
        try:
            payload = message.payload  # the wire decoder: total, cached for the strategy
        except ContentDisallowed:
            return True  # on_invalid_task records it
        if not deliveries.redelivered(message.delivery_info):
            return True  # a first delivery: counted only if it comes back (worker/deliveries.py)
        key = deliveries.message_key(task_id, _body_of(message))
        claimed = deliveries.claimed_action_id(payload)
        try:
            faultpoints.hit("before_count", claimed)  # test-only: a count that fails, as when Postgres is away
            counts = _main.run(lambda conn: deliveries.count(conn, key, task_name, claimed, unrecorded_before=True))
        except Exception as exc:  # noqa: BLE001 - counting must not stop work when Postgres is away
            log.warning("delivery not counted", extra={"event": "delivery_uncounted", "error": type(exc).__name__})
            return True
        limit = get_settings().max_unsettled_deliveries
        if counts["unsettled"] > limit:
            self._dead_letter(message, key, counts, claimed, worker_id)
            return False
        return True

    def _dead_letter(self, message: Any, key: str, counts: dict[str, Any], action_id: str | None,
                     worker_id: str) -> None:
        body = _body_of(message)
        moved = True
        try:
            with self.app.producer_or_acquire() as producer:
                producer.publish(body, exchange="", routing_key=deliveries.DEAD_LETTER_QUEUE,
                                 declare=[dead_letter_queue(self.app)],
                                 headers=message.headers, content_type=message.content_type,
                                 content_encoding=message.content_encoding, retry=True,
                                 retry_policy={"max_retries": 3})
        except Exception as exc:  # noqa: BLE001 - still recorded and taken off the work queue
            moved = False
            log.error("dead-letter publish failed", extra={"event": "dead_letter_failed", "error": type(exc).__name__})
        evidence = {"reason_code": "dead_lettered", "message_key": key, "deliveries": counts["deliveries"],
                    "unsettled": counts["unsettled"],
                    "excused": counts.get("excused", 0), "last_error": counts.get("last_error"),
                    "queue": deliveries.DEAD_LETTER_QUEUE if moved else None,
                    "message_digest": wire.digest(body), "task": message.headers.get("task"),
                    "claimed": {"action_id": action_id} if action_id else {}, "by": "consumer"}
        _main.run(record, "refused:" + wire.digest(body)[:40], "dead_lettered", worker_id, evidence)
        _main.run(deliveries.mark_dead, key)
        log.error("message dead-lettered after %s deliveries without an outcome", counts["unsettled"],
                  extra={"event": "dead_lettered", "message_key": key, "action_id": action_id})
        _settle_message(message)

    # Celery's rejection paths, each recorded instead of only logged.
    def on_unknown_message(self, body: Any, message: Any) -> None:
        refuse_message(message, "message_malformed", "not a task message (no task header)",
                       get_settings().worker_id)

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        refuse_message(message, "message_unknown_task", f"unknown task: {safe_repr(exc, 200)}",
                       get_settings().worker_id)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        if isinstance(exc, ContentDisallowed):
            reason = "message_content_type_refused"
            detail = f"content type {safe_repr(message.content_type, 80)} is not accepted"
        else:
            reason, detail = "message_malformed", f"invalid task message: {safe_repr(exc, 200)}"
        refuse_message(message, reason, detail, get_settings().worker_id)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        refuse_message(message, "message_undecodable", f"undecodable: {type(exc).__name__}",
                       get_settings().worker_id)
