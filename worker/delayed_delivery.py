"""Native delayed delivery set up once per cluster, not once per node of the broker URL list.

Celery 5.7's ``DelayedDelivery`` consumer step declares the ``celery_delayed_*`` exchanges and
queues and binds every configured queue to them for *each* URL of a ``;``-separated broker URL,
retrying a URL that does not answer three times (1 s, 3 s, 5 s apart). For a RabbitMQ cluster the
list names the nodes of one broker, and what is declared on one node exists on all. The step runs
each time the consumer (re)connects, before its event loop starts: after the node at the head of
the list died, every reconnect of every worker waited about twenty seconds on the dead node before
it received a message again (measured here with three nodes).

This step declares on the node the consumer has just connected to (else the first node of the
list that answers) and stops there; only when none
answers does it go round the list again, :data:`ROUNDS` times in all, and then it logs what Celery
logs (delayed delivery unavailable) and lets the consumer start: a countdown then fails at publish,
and the task is retried by the reconciler from the ledger. It uses the pinned Celery's own
declaration helper (``_setup_delayed_delivery``), so what is declared is exactly Celery's.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import urlsplit

from celery.worker.consumer.delayed_delivery import DelayedDelivery
from kombu.utils.url import maybe_sanitize_url

log = logging.getLogger("proofline.worker")

#: Passes over the URL list before giving up; :data:`PAUSE` seconds between two passes.
ROUNDS = 3
PAUSE = 1.0


def _live_first(urls: list[str], connection: Any) -> list[str]:
    """The URL of the node the consumer has just connected to first (it answered a moment ago),
    then the others in their order: a dead node at the head of the list costs no connect attempt."""
    host, port = getattr(connection, "hostname", None), getattr(connection, "port", None)

    def elsewhere(url: str) -> bool:
        parts = urlsplit(url)
        try:
            return (parts.hostname, parts.port) != (host, port)
        except ValueError:  # a port that is not a number: leave the URL where it is
            return True

    return sorted(urls, key=elsewhere) if host else urls


class ClusterDelayedDelivery(DelayedDelivery):
    """``DelayedDelivery`` declared on the first node that answers (one broker, many URLs)."""

    def start(self, c: Any) -> None:
        app = c.app
        self._validate_configuration(app)
        urls = _live_first(self._validate_broker_urls(app.conf.broker_url), getattr(c, "connection", None))
        for round_ in range(ROUNDS):
            for url in urls:
                try:
                    self._setup_delayed_delivery(c, url)
                    return
                except Exception as exc:  # noqa: BLE001 - a node that does not answer: try the next
                    log.warning("delayed delivery not set up on %s: %s", maybe_sanitize_url(url), type(exc).__name__,
                                extra={"event": "delayed_delivery_node_failed"})
            if round_ + 1 < ROUNDS:
                time.sleep(PAUSE)
        log.critical("delayed delivery could not be set up on any broker node",
                     extra={"event": "delayed_delivery_unavailable"})
