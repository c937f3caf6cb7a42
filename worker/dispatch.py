"""How runtime code puts follow-up work on the queues, without importing the Celery app."""

from __future__ import annotations

from typing import Any, Protocol


class Dispatch(Protocol):
    def verify(self, action_id: str) -> None: ...

    def recover(self, action_id: str) -> None: ...

    def execute(self, message: dict[str, Any], queue: str = "actions", task_id: str | None = None,
                countdown: float | None = None) -> str: ...

    def revoke(self, task_id: str) -> None: ...


class CeleryDispatch:
    """The production dispatcher: stable task names, JSON only, one queue per kind of work."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def verify(self, action_id: str) -> None:
        self.app.send_task("proofline.verify", args=[action_id], queue="verify", serializer="json")

    def recover(self, action_id: str) -> None:
        # Its own queue: only recovery processes (which hold the recovery key) consume it.
        self.app.send_task("proofline.recover", args=[action_id], queue="recovery", serializer="json")

    def execute(self, message: dict[str, Any], queue: str = "actions", task_id: str | None = None,
                countdown: float | None = None) -> str:
        """Send an execute message. ``countdown`` is only ever a short retry backoff: deadlines are
        kept in Postgres, never in broker ETAs."""
        name = "proofline.compensate" if queue == "compensate" else "proofline.execute"
        return str(self.app.send_task(name, args=[message], queue=queue, serializer="json", task_id=task_id,
                                      countdown=countdown).id)

    def revoke(self, task_id: str) -> None:
        self.app.control.revoke(task_id)
