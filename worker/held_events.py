"""Task events whose publish failed are sent again within seconds, not only at the next task event.

With task events on (``PROOFLINE_TASK_EVENTS``, what Flower shows), Celery's event dispatcher keeps
an event whose publish raised (a broker connection reset, a refused command, a broker restarting)
in a buffer of its own and tries it again only when the worker sends another task event. A worker
whose last task before a quiet spell met such an error never shows that task's end: Flower keeps
the action running, or never lists its recovery, until some unrelated task comes along.

This consumer step asks the dispatcher to send what it holds every :data:`FLUSH_SECONDS`, on the
worker's event loop (the thread that sends the events, so the dispatcher's connection is never used
from two threads). An empty buffer costs a lock and nothing else. A pool without an event loop
(``solo``, ``threads``) is left as Celery runs it.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

log = logging.getLogger(__name__)

#: How often events held back by a failed publish are tried again.
FLUSH_SECONDS = 2.0


class HeldEventsFlush(bootsteps.StartStopStep):
    """Sends the event dispatcher's held events again, every :data:`FLUSH_SECONDS`."""

    requires = ("celery.worker.consumer.events:Events",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._entry: Any = None

    def include_if(self, parent: Any) -> bool:
        return bool(parent.app.conf.worker_send_task_events)

    def start(self, parent: Any) -> None:
        hub = getattr(parent, "hub", None)
        if hub is None:
            return
        self._entry = hub.call_repeatedly(FLUSH_SECONDS, flush_held, parent)

    def stop(self, parent: Any) -> None:
        if self._entry is not None:
            self._entry.cancel()
            self._entry = None

    shutdown = stop


def flush_held(consumer: Any) -> None:
    """Publish what the consumer's event dispatcher holds; a publish that fails again stays held."""
    dispatcher = getattr(consumer, "event_dispatcher", None)
    if dispatcher is None or not dispatcher.enabled:
        return
    try:
        dispatcher.flush()
    except Exception as exc:  # noqa: BLE001 - never stop the event loop over a monitor's view
        log.warning("held task events not sent", extra={"event": "task_events_unsent", "error": type(exc).__name__})
