"""The base class of every Proofline task, in the pool process.

- A body the wire decoder replaced with a :class:`~worker.wire.RefusedBody`, or arguments that do
  not fit the task, are recorded as ``envelope_refused`` and never run.
- Whenever the task gets control back (a result, a retry, a refusal), the consumer's delivery count
  for a redelivered message is settled; only a delivery that ends its process leaves it unsettled
  (a first delivery is not counted: ``worker/deliveries.py``).
- A delivery that fails past its retry limit is recorded as ``delivery_abandoned`` (the ledger,
  not Celery's failure log, is where it ends) and the reconciler re-drives the action later. Neither
  the envelope nor the task's arguments are ever logged.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import psycopg
from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from ledger.refusals import record
from proofline.bounded import safe_repr
from worker import deliveries, wire
from worker.broker import whole_seconds
from worker.dispatch import task_repr
from worker.summary import task_line
from worker.validate import claimed_fields

log = logging.getLogger(__name__)


def _misfit(fn: Any, args: tuple, kwargs: dict) -> str | None:
    """Why these arguments cannot be passed to ``fn``: wrong count or names, or a value that is not
    the short string a ``str`` parameter (an action id) must be. None when they fit."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        return str(exc)
    params = inspect.signature(fn).parameters
    for name, value in bound.arguments.items():
        if params[name].annotation in ("str", str) and not (isinstance(value, str) and len(value) <= 200):
            return f"{name} must be a string of at most 200 characters"
    return None


class GuardedTask(Task):
    abstract = True
    #: Success events carry the action's outcome as the task's state (worker/task_request.py), and
    #: a delivery whose pool process was killed from outside is not counted against its message by
    #: the guard (worker/lost_delivery.py). One request class for every task: a task option would
    #: replace it, not add to it.
    Request = "worker.lost_delivery:GuardedRequest"

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        # Every publication shows the action id and a digest, never the envelope: Celery's own
        # retries compute a full repr for their ``task-sent`` event before any hook runs.
        if options.get("argsrepr") is None:
            options["argsrepr"], options["kwargsrepr"] = task_repr(args or (), kwargs)
        if "countdown" in options:
            options["countdown"] = whole_seconds(options["countdown"])
        return super().apply_async(args, kwargs, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from worker.runtime import runtime

        rt = runtime()
        key = deliveries.message_key(self.request.id, None)
        placeholder = next((a for a in (*args, *kwargs.values()) if isinstance(a, wire.RefusedBody)), None)
        if placeholder is None:
            problem = _misfit(self.run, args, kwargs)
            if problem is not None:
                placeholder = wire.refused("message_malformed", f"arguments do not fit {self.name}: {problem}",
                                           safe_repr((args, kwargs), 2000))
        if placeholder is not None:
            self._refuse(rt, placeholder)
            self._settle(rt, key, "refused")
            return task_line({"status": "refused", "reason_code": placeholder.reason})
        try:
            result = self.run(*args, **kwargs)
        except Retry as retry:
            cause = retry.exc
            self._settle(rt, key, "retry", None if cause is None else f"{type(cause).__name__}: {safe_repr(cause)}")
            raise
        except (Ignore, Reject):
            self._settle(rt, key, "ignored")
            raise
        except Exception as exc:  # noqa: BLE001 - past the retry limit: recorded, never re-raised into Celery
            return self._abandon(rt, key, args, exc)
        self._settle(rt, key, "returned")
        return result

    def _refuse(self, rt: Any, body: wire.RefusedBody) -> None:
        evidence = {**body.evidence(), "task": self.name, "task_id": self.request.id,
                    "redelivered": bool((self.request.delivery_info or {}).get("redelivered"))}
        record(rt.conn, "refused:" + body.digest[:40], "envelope_refused", rt.settings.worker_id, evidence)

    def _settle(self, rt: Any, key: str, outcome: str, error: str | None = None) -> None:
        if not deliveries.redelivered(self.request.delivery_info):
            return  # a first delivery was never counted (worker/deliveries.py): nothing to settle
        try:
            deliveries.settle(rt.conn, key, outcome, error)
        except Exception as exc:  # noqa: BLE001 - the count is a safety net; never fail a task for it
            log.warning("delivery count not settled", extra={"event": "delivery_unsettled",
                                                              "error": type(exc).__name__})

    def _abandon(self, rt: Any, key: str, args: tuple, exc: Exception) -> str:
        error = f"{type(exc).__name__}: {safe_repr(exc)}"
        claimed = claimed_fields(args[0]) if args else {}
        if not claimed and args and isinstance(args[0], str):
            claimed = {"action_id": args[0][:200]}
        log.error("delivery abandoned after %s retries", self.request.retries,
                  extra={"event": "delivery_abandoned", "task": self.name, "task_id": self.request.id,
                         "action_id": claimed.get("action_id"), "error": type(exc).__name__})
        try:
            if isinstance(exc, psycopg.OperationalError):
                rt.reset_connection()
            record(rt.conn, f"delivery:{self.request.id}", "delivery_abandoned", rt.settings.worker_id,
                   {"reason_code": "delivery_abandoned", "task": self.name, "retries": self.request.retries,
                    "error": error, "claimed": claimed})
            self._settle(rt, key, "abandoned", error)
        except Exception as again:  # noqa: BLE001 - the ledger is away too: leave it to the reconciler
            log.error("abandoned delivery not recorded", extra={"event": "delivery_abandoned_unrecorded",
                                                                "error": type(again).__name__})
        return task_line({"status": "abandoned", "action_id": claimed.get("action_id"), "error": type(exc).__name__})
