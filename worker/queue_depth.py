"""Ready messages per queue on an AMQP broker, read without taking any (a passive declare).

Used by the exporter (``proofline_queue_depth``) and by the reconciler's backlog check on AMQP.
"""

from __future__ import annotations

from typing import Any


def amqp_ready(conn: Any, queues: list[str]) -> dict[str, int]:
    """Ready messages in each queue over an open kombu connection; a queue nobody declared yet holds none."""
    from amqp.exceptions import NotFound

    counts: dict[str, int] = {}
    for queue in queues:
        channel = conn.channel()  # a 404 closes the channel, so one per queue
        try:
            counts[queue] = int(channel.queue_declare(queue, passive=True).message_count)
        except NotFound:
            counts[queue] = 0
        finally:
            channel.close()
    return counts
