"""A Redis channel closed after its connection was lost does not take the worker down.

kombu closes a Redis channel by disconnecting its pools first and then putting back the messages
it delivered and nobody acknowledged, through a client made from a new pool. When the channel is
closed because the connection was lost (Redis killed), the connection is already gone by then and
building that pool raised ``AttributeError`` (``'NoneType' object has no attribute 'hostname'``):
not a connection error, so nothing swallowed it, and Celery's main process died ("Unrecoverable
error"; six times in a 2,000-item soak, each a supervisor restart). The guarded channel answers
with a connection error instead, which the close ignores, as it ignores every other error of a
connection that is gone. The unacknowledged messages stay where Redis keeps them (the ``unacked``
hash, restored after the visibility timeout); the ledger's reconciler re-drives their actions.
"""

from __future__ import annotations

from kombu import Connection

from proofline_kit.resources import claim_redis_db, release_redis_db


def test_closing_a_channel_whose_connection_is_gone_raises_nothing() -> None:
    claim = claim_redis_db()
    try:
        with Connection(claim.url, transport="worker.transport:GuardedRedisTransport") as conn:
            channel = conn.channel()
            channel.basic_publish(channel.prepare_message(b"{}"), exchange="", routing_key="soak-close")
            channel.queue_declare("soak-close")
            message = channel.basic_get("soak-close", no_ack=False)
            assert message is not None  # delivered, never acknowledged: the close restores it
            channel._disconnect_pools()
            channel.connection.client = None  # what a lost connection leaves when the close runs
            conn.maybe_close_channel(channel)  # raised AttributeError before
            assert channel.closed
    finally:
        release_redis_db(claim)
