"""How runtime code puts follow-up work on the queues, without importing the Celery app.

What a task message *shows* (its ``argsrepr``/``kwargsrepr`` headers: Flower's task view, the
``task-received`` event, Celery's log lines) is only the action id and a digest of the message:
the envelope carries argument values, and those are not for dashboards. The broker body itself
still holds the signed message the worker must verify.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from typing import Any, Protocol

from celery import signals

from ledger.redact import scrub_text
from proofline.canonical import canonical_bytes
from proofline.settings import get_settings
from proofline.shards import BASE_QUEUE, REDIS_PRIORITY_SUFFIXES, VERIFY_QUEUE, queue_for_tenant
from worker import wire
from worker.broker import whole_seconds
from worker.queue_depth import amqp_ready

_ACTION_ID = re.compile(r"[A-Za-z0-9._:-]{1,200}")
#: The header every Proofline task message carries: when it was sent (epoch seconds).
SENT_AT = "proofline_sent_at"


def _sent_at(raw: bytes | None) -> float | None:
    """The send time in a raw Redis message, if it is one of ours and well formed (the broker's
    content is not trusted: anything else is None)."""
    if not raw:
        return None
    try:
        value = json.loads(raw)["headers"][SENT_AT]
    except (ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _digest(value: Any) -> str:
    try:
        raw = canonical_bytes(value)
    except Exception:  # noqa: BLE001 - any input at all gets a digest
        raw = repr(value).encode(errors="replace")
    return "sha256:" + hashlib.sha256(raw).hexdigest()[:16]


def _action_id(value: Any) -> str:
    if isinstance(value, dict) and isinstance(value.get("envelope"), dict):
        value = value["envelope"].get("action_id")
    if isinstance(value, str) and _ACTION_ID.fullmatch(value):
        return scrub_text(value)
    return "?"


def task_repr(args: Any, kwargs: Any = None) -> tuple[str, str]:
    """``(argsrepr, kwargsrepr)`` for a Proofline task: the action id and a digest, nothing else."""
    args = list(args or ())
    first = args[0] if len(args) == 1 else args
    shown = repr((_action_id(first), _digest(first))) if isinstance(first, dict | list) else repr(
        tuple(_action_id(a) for a in args))
    return shown, (repr({"digest": _digest(kwargs)}) if kwargs else "{}")


@signals.before_task_publish.connect
def _hide_arguments(sender: str | None = None, body: Any = None, headers: dict[str, Any] | None = None,
                    **_: Any) -> None:
    """Every path that publishes a Proofline task (Celery's own retries included, which compute
    a full repr) shows the same summary: the headers dict here is the one that is published."""
    if headers is None or not str(sender or headers.get("task", "")).startswith("proofline."):
        return
    headers[SENT_AT] = time.time()  # how old the oldest waiting message is (recovery/backlog.py)
    if isinstance(body, tuple | list) and len(body) >= 2:
        headers["argsrepr"], headers["kwargsrepr"] = task_repr(body[0], body[1])


class Dispatch(Protocol):
    def verify(self, action_id: str, tenant: str | None = None) -> None: ...

    def recover(self, action_id: str) -> None: ...

    def recheck(self, check_id: int, attempt: int, tenant: str | None = None) -> None: ...

    def execute(self, message: dict[str, Any], queue: str = "actions", task_id: str | None = None,
                countdown: float | None = None) -> str: ...

    def revoke(self, task_id: str) -> None: ...

    def oldest_waiting(self, queues: list[str]) -> dict[str, float]: ...

    def ready_counts(self, queues: list[str]) -> dict[str, int]: ...

    def settled(self, conn: Any, actor: str, action_id: str, **known: Any) -> None: ...


def _label(message: Any) -> str:
    """What Celery may log for an execute message: the action id it claims, never the envelope."""
    env = message.get("envelope") if isinstance(message, dict) else None
    action_id = env.get("action_id") if isinstance(env, dict) else None
    return f"(<envelope {str(action_id)[:120]}>,)"


class CeleryDispatch:
    """The production dispatcher: stable task names, the guarded JSON wire format (``worker/wire.py``)
    only, one queue per kind of work."""

    def __init__(self, app: Any, tenant_shards: int | None = None, on_settled: Callable[..., None] | None = None) -> None:
        self.app = app
        self.tenant_shards = tenant_shards if tenant_shards is not None else get_settings().tenant_shards
        self.on_settled = on_settled

    def settled(self, conn: Any, actor: str, action_id: str, **known: Any) -> None:
        """What an action settling means for others (its run, the action it compensates): the hook
        the Celery app module wires in (``recovery/settle.py``), so the execute stage imports no
        recovery code. A dispatcher without one (a controller's, an operator's) settles nothing
        here; the reconciler catches up with anything left unsettled."""
        if self.on_settled is not None:
            self.on_settled(conn, actor, action_id, self, **known)

    def verify(self, action_id: str, tenant: str | None = None) -> None:
        # The tenant's verify shard, so that a burst's verifications do not delay another tenant's.
        self._send("proofline.verify", [action_id], queue=queue_for_tenant(tenant, self.tenant_shards, VERIFY_QUEUE))

    def recover(self, action_id: str) -> None:
        # Its own queue: only recovery processes (which hold the recovery key) consume it.
        self._send("proofline.recover", [action_id], queue="recovery")

    def recheck(self, check_id: int, attempt: int, tenant: str | None = None) -> None:
        # A post-condition re-check is a verification read: the tenant's verify shard, the worker role.
        self._send("proofline.recheck", [check_id, attempt],
                   queue=queue_for_tenant(tenant, self.tenant_shards, VERIFY_QUEUE))

    def read(self, message: dict[str, Any], tenant: str | None = None) -> None:
        # A gateway read runs as the worker role, through the read identity: the tenant's verify shard.
        self._send("proofline.read", [message], queue=queue_for_tenant(tenant, self.tenant_shards, VERIFY_QUEUE))

    def _send(self, name: str, args: list[Any], **options: Any) -> Any:
        # The summary is given here, not only by ``_hide_arguments`` on the message's headers: the
        # ``task-sent`` event carries what is passed here, and a monitor that receives it after the
        # worker's ``task-received`` (they come from different processes) takes its arguments, so a
        # placeholder would show the task with no action id. It also stops Celery computing a full
        # repr of the envelope.
        argsrepr, kwargsrepr = task_repr(args)
        return self.app.send_task(name, args=args, serializer=wire.NAME, argsrepr=argsrepr, kwargsrepr=kwargsrepr,
                                  **options)

    def execute(self, message: dict[str, Any], queue: str = "actions", task_id: str | None = None,
                countdown: float | None = None) -> str:
        """Send an execute message. ``countdown`` is only ever a short retry backoff: deadlines are
        kept in Postgres, never in broker ETAs.

        ``queue="actions"`` (every caller's default) means "the execute queue": the message goes to
        its tenant's shard (``proofline/shards.py``) so one tenant's burst cannot starve another.
        Any other queue (``compensate``) is used as asked."""
        name = "proofline.compensate" if queue == "compensate" else "proofline.execute"
        if queue == BASE_QUEUE:
            env = message.get("envelope") if isinstance(message, dict) else None
            queue = queue_for_tenant(env.get("tenant") if isinstance(env, dict) else None, self.tenant_shards)
        return str(self._send(name, [message], queue=queue, task_id=task_id, countdown=whole_seconds(countdown)).id)

    def revoke(self, task_id: str) -> None:
        self.app.control.revoke(task_id)

    def ready_counts(self, queues: list[str]) -> dict[str, int]:
        """Ready messages in each queue on an AMQP broker, read without taking any (a passive
        declare); ``{}`` on any other broker (Redis is looked into by :meth:`oldest_waiting`).
        Raises when the broker cannot be reached."""
        with self.app.connection_for_read() as conn:
            if conn.transport.driver_type != "amqp":  # known from the URL, before any connection
                return {}
            conn.ensure_connection(max_retries=1, timeout=5)
            return amqp_ready(conn, queues)

    def oldest_waiting(self, queues: list[str]) -> dict[str, float]:
        """The send time (``proofline_sent_at``) of the oldest message waiting in each queue, where
        the broker lets us look without taking it: the tail of a Redis list (kombu pushes on the
        left and pops on the right; priorities 3, 6 and 9 have lists of their own). A queue that is
        empty, on another broker, or whose oldest message carries no send time is left out.
        Raises when the broker cannot be reached (``recovery/backlog.py`` decides what that means)."""
        with self.app.connection_for_read() as conn:
            if conn.transport.driver_type != "redis":  # known from the URL, before any connection
                return {}
            conn.ensure_connection(max_retries=1, timeout=5)
            client = getattr(conn.default_channel, "client", None)
            if client is None:
                return {}
            with client.pipeline(transaction=False) as pipe:
                for queue in queues:
                    for suffix in REDIS_PRIORITY_SUFFIXES:
                        pipe.lindex(queue + suffix, -1)
                tails = pipe.execute()
        found: dict[str, float] = {}
        for i, queue in enumerate(queues):
            times = [t for t in (_sent_at(raw) for raw in tails[i * len(REDIS_PRIORITY_SUFFIXES):(i + 1) * len(REDIS_PRIORITY_SUFFIXES)])
                     if t is not None]
            if times:
                found[queue] = min(times)
        return found
