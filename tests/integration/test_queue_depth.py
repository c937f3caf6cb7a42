"""The exporter's queue depths read from a real broker, Redis and RabbitMQ alike."""

from __future__ import annotations

import redis
from kombu import Connection

from proofline.settings import Settings
from proofline.telemetry.ledger_metrics import LedgerCollector
from worker import broker as broker_options


def test_depth_counts_what_waits_and_zero_for_an_undeclared_queue(broker_url: str) -> None:
    waiting = {"actions.1": 3, "verify": 1}
    if broker_options.is_amqp(broker_url):
        queues = {q.name: q for q in broker_options.quorum_queues(Settings(broker_url=broker_url))}
        with Connection(broker_url, transport_options={"confirm_publish": True}) as conn:
            for name, n in waiting.items():
                for _ in range(n):
                    conn.Producer().publish(b"[[], {}, {}]", routing_key=name, exchange="", declare=[queues[name]])
    else:
        client = redis.Redis.from_url(broker_url)
        for name, n in waiting.items():
            client.lpush(name, *[b"{}"] * n)
        client.close()
    collector = LedgerCollector("postgresql://unused", broker_url, ["actions.1", "verify", "compensate"])
    (family,) = list(collector._queue_families())
    depths = {s.labels["queue"]: s.value for s in family.samples}
    assert depths == {"actions.1": 3.0, "verify": 1.0, "compensate": 0.0}
