"""How runtime code puts follow-up work on the queues, without importing the Celery app."""

from __future__ import annotations

from typing import Any, Protocol

from worker import wire


class Dispatch(Protocol):
    def verify(self, action_id: str) -> None: ...

    def recover(self, action_id: str) -> None: ...

    def execute(self, message: dict[str, Any], queue: str = "actions", task_id: str | None = None,
                countdown: float | None = None) -> str: ...

    def revoke(self, task_id: str) -> None: ...


def _label(message: Any) -> str:
    """What Celery may log for an execute message: the action id it claims, never the envelope."""
    env = message.get("envelope") if isinstance(message, dict) else None
    action_id = env.get("action_id") if isinstance(env, dict) else None
    return f"(<envelope {str(action_id)[:120]}>,)"


class CeleryDispatch:
    """The production dispatcher: stable task names, the guarded JSON wire format (``worker/wire.py``)
    only, one queue per kind of work."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def verify(self, action_id: str) -> None:
        self.app.send_task("proofline.verify", args=[action_id], queue="verify", serializer=wire.NAME)

    def recover(self, action_id: str) -> None:
        self.app.send_task("proofline.recover", args=[action_id], queue="reconcile", serializer=wire.NAME)

    def execute(self, message: dict[str, Any], queue: str = "actions", task_id: str | None = None,
                countdown: float | None = None) -> str:
        """Send an execute message. ``countdown`` is only ever a short retry backoff: deadlines are
        kept in Postgres, never in broker ETAs."""
        name = "proofline.compensate" if queue == "compensate" else "proofline.execute"
        return str(self.app.send_task(name, args=[message], queue=queue, serializer=wire.NAME, task_id=task_id,
                                      countdown=countdown, argsrepr=_label(message), kwargsrepr="{}").id)

    def revoke(self, task_id: str) -> None:
        self.app.control.revoke(task_id)
