"""A monitor of a stack's task events, subscribed as Flower is: every event the broker hands it."""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from celery import Celery


class EventMonitor:
    """Every event on ``broker_url`` (its user dropped: it connects as the server's default user),
    received on a thread of its own from the moment the constructor returns."""

    def __init__(self, broker_url: str) -> None:
        parts = urlsplit(broker_url)
        self.app = Celery("monitor", broker=urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path,
                                                        "", "")))
        self.events: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self.receiver: Any = None
        self.thread = threading.Thread(target=self._run, name="event-monitor", daemon=True)
        self.thread.start()
        assert self.ready.wait(30), "the event monitor did not subscribe"

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self.receiver = self.app.events.Receiver(conn, handlers={"*": self.events.append})
            # Subscribed once its consumers are declared; it looks at should_stop every half second.
            self.receiver.on_consume_ready = lambda *_, **__: self.ready.set()
            for _ in self.receiver.consume(limit=None, timeout=None, safety_interval=0.5, wakeup=False):
                pass

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.thread.join(5)
        self.app.close()

    def ended(self, action_id: str) -> list[dict[str, Any]]:
        """The events that end a task about ``action_id`` (they carry its Proofline line)."""
        return [e for e in list(self.events) if e.get("type", "").startswith("task-")
                and f"action={action_id}" in str(e.get("result") or "")]

    def tasks_of(self, action_id: str) -> dict[str, list[str]]:
        """The task names received for ``action_id`` (by task id), each with the event types seen."""
        events = list(self.events)
        names = {e["uuid"]: e.get("name") for e in events
                 if e.get("type") == "task-received" and action_id in str(e.get("args") or "")}
        seen: dict[str, list[str]] = {}
        for e in events:
            if e.get("uuid") in names:
                seen.setdefault(f"{names[e['uuid']]} {e['uuid'][:8]}", []).append(e["type"])
        return seen

    def task_ids_of(self, action_id: str) -> set[str]:
        """The ids of the tasks received for ``action_id``."""
        return {e["uuid"] for e in list(self.events)
                if e.get("type") == "task-received" and action_id in str(e.get("args") or "")}
