"""The Redis transport, guarded where kombu parses what it pops from a queue.

kombu keeps each message in Redis as a JSON document (body, headers, properties) and parses it
in the consumer right after ``BRPOP`` has removed it from the list. A document that is not JSON,
nests too deep or lacks the fields kombu reads raises there, in the consumer's event loop: the
message is already gone from Redis, and the worker dies (anyone who can write to Redis could do
this). Here such a document is replaced by a well-formed message whose body carries the raw bytes
behind a prefix no JSON body can have, so the wire decoder refuses it (``message_undecodable``)
and the execute task records the refusal with an excerpt and digest of what arrived.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from typing import Any

import redis as redis_py
from kombu.transport import TRANSPORT_ALIASES, redis
from kombu.utils.encoding import bytes_to_str

from worker import wire

QUARANTINE_PREFIX = wire.QUARANTINE_PREFIX
#: kombu's own document nests four or five levels; headers a few more.
MAX_DOCUMENT_DEPTH = 64
#: kombu's document holds the body base64-encoded (a third larger) with headers and properties:
#: past this, no body in it could be one the wire decoder accepts.
MAX_DOCUMENT_BYTES = 4 * wire.MAX_BODY_BYTES


# The task id a damaged document still names, so its refusal can be traced to what was sent.
_TASK_ID = re.compile(rb'"id":\s*"([0-9A-Za-z._:-]{1,64})"')


def _quarantine(raw: bytes | str, queue: str, body: bytes | None = None) -> dict[str, Any]:
    data = raw if isinstance(raw, bytes) else str(raw).encode("utf-8", "surrogatepass")
    named = _TASK_ID.search(data)  # headers follow the (base64) body in kombu's document
    if body is None:
        body = QUARANTINE_PREFIX + data[: wire.MAX_BODY_BYTES + 1]
    tag = str(uuid.uuid4())
    return {
        "body": base64.b64encode(body).decode(), "content-type": wire.CONTENT_TYPE, "content-encoding": "binary",
        "headers": {"task": "proofline.execute", "lang": "py",
                    "id": named.group(1).decode() if named else "broker-" + wire.digest(data)[:32],
                    "retries": 0, "argsrepr": "()", "kwargsrepr": "{}"},
        "properties": {"delivery_tag": tag, "body_encoding": "base64", "priority": 0,
                       "delivery_info": {"exchange": "", "routing_key": queue}},
    }


def guarded_document(raw: bytes | str, queue: str) -> dict[str, Any]:
    """kombu's message document, or a quarantine message standing in for it. The size is checked
    before anything decodes the document, and an oversize one is refused with its true size."""
    try:
        if len(raw) > MAX_DOCUMENT_BYTES:
            data = raw if isinstance(raw, bytes) else str(raw).encode("utf-8", "surrogatepass")
            return _quarantine(data, queue, wire.oversize_body(data, MAX_DOCUMENT_BYTES))
        text = bytes_to_str(raw)
        if wire.max_depth(text, MAX_DOCUMENT_DEPTH) > MAX_DOCUMENT_DEPTH:
            return _quarantine(raw, queue)
        doc = json.loads(text)
        props = doc.get("properties") if isinstance(doc, dict) else None
        if not isinstance(props, dict) or not isinstance(props.get("delivery_tag"), str):
            return _quarantine(raw, queue)
        if not isinstance(doc.get("headers", {}), dict) or not isinstance(doc.get("body", ""), str):
            return _quarantine(raw, queue)
        if props.get("body_encoding") == "base64":
            base64.b64decode(doc.get("body", ""), validate=True)
        info = props.get("delivery_info")
        if not isinstance(info, dict) or not isinstance(info.get("routing_key", ""), str):
            props["delivery_info"] = {"exchange": "", "routing_key": queue}
        doc.setdefault("headers", {})
        return doc
    except (ValueError, TypeError, RecursionError, binascii.Error, UnicodeDecodeError):
        return _quarantine(raw, queue)


class GuardedChannel(redis.Channel):
    """kombu's Redis channel with the two reads of a queued document guarded, and one synchronous
    client per channel."""

    _sync_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        """kombu builds a new ``redis.Redis`` for every ack and every publish, and redis-py fills a
        table of some 150 response callbacks for each (a third of the Celery main process's time
        per message, measured). The client holds no connection of its own (it borrows from the
        channel's pool per command), so one per channel and pool serves them all."""
        pool_left = self._async_pool if asynchronous else self._pool
        if pool_left is None and getattr(self.connection, "client", None) is None:
            # kombu closes a channel by disconnecting its pools and then putting back what it
            # delivered unacknowledged, through a new pool built from the connection's parameters.
            # Closed because the connection was lost, there are none left: kombu's AttributeError
            # there killed Celery's main process. A connection error is what the close ignores.
            raise redis_py.exceptions.ConnectionError("the channel's connection is gone")
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        client = self._sync_client
        if client is None or client.connection_pool is not pool:
            client = self._sync_client = super()._create_client()
        return client

    def _brpop_read(self, **options: Any) -> bool:
        try:
            try:
                reply = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            if not reply:
                raise redis.Empty()
            dest, item = reply
            dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            self.connection._deliver(guarded_document(item, dest), dest)
            return True
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def _get(self, queue: str) -> dict[str, Any]:
        with self.conn_or_acquire() as client:
            for pri in self.priority_steps:
                item = client.rpop(self._q_for_pri(queue, pri))
                if item:
                    self._maybe_update_queues_expire(client, queue)
                    return guarded_document(item, queue)
            self._maybe_update_queues_expire(client, queue)
            raise redis.Empty()


class GuardedRedisTransport(redis.Transport):
    Channel = GuardedChannel


def install() -> None:
    """Make ``redis://`` URLs use the guarded transport in this process (the worker)."""
    TRANSPORT_ALIASES["redis"] = "worker.transport:GuardedRedisTransport"
