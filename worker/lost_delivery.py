"""Telling a message that ends its pool process from a pool process killed under it.

The message guard (``worker/guard.py``) takes a message whose deliveries keep ending their process
without an outcome for a poison message, and dead-letters it after ``max_unsettled_deliveries``.
A pool process killed from outside (an operator's ``kill``, a chaos tool, a supervisor reclaiming
it) ends the same way, and where kills are frequent a message can be handed to a doomed process
several times in a row through no fault of its own; dead-lettered, its action waits for the
reconciler's re-send.

What a message can do to its own process: raise (settled, never counted), crash in native code
(SIGSEGV, SIGABRT, SIGBUS: counted), exit (an exit code: counted), or grow until the kernel's
out-of-memory killer sends SIGKILL. So a process that ended by SIGKILL or SIGTERM while the node's
out-of-memory kill counter (``oom_kill`` in ``/proc/vmstat``, which counts cgroup kills too) did
not move since the message arrived was killed from outside: :class:`GuardedRequest`, in the
worker's main process, records that delivery as *excused* (``message_deliveries.excused``) before
Celery requeues the message, and the guard does not count it. Up to ``max_excused_deliveries`` per
message: past it, every death counts again, so no message is handed out without bound. Whenever
the counter cannot be read, or moved, or the exit is anything else, nothing is excused.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import WorkerLostError

from proofline.settings import get_settings
from proofline.telemetry.events import bounded
from proofline.telemetry.metrics import DELIVERIES_LOST
from worker import deliveries, in_flight
from worker.guard import _body_of, _main
from worker.oom_count import killed_from_outside, oom_kills
from worker.task_request import OutcomeRequest

log = logging.getLogger(__name__)

#: How billiard words the loss (``human_status``): "signal 9 (SIGKILL)" or "exitcode 1".
_LOST = re.compile(r"^Worker exited prematurely: (?:signal (\d+) \(|exitcode (-?\d+)\b)")


def exit_status(exc: BaseException) -> int | None:
    """The lost process's exit status (a negative signal number for a signal) as billiard words it
    in its :class:`WorkerLostError` (Celery's prefork pool records it nowhere else); None if unsaid."""
    m = _LOST.match(str(exc))
    if m is None:
        return None
    return -int(m.group(1)) if m.group(1) is not None else int(m.group(2))


class GuardedRequest(OutcomeRequest):
    """The tasks' request (which already sends Flower the action's outcome as the task's state):
    it notes the out-of-memory count when its message arrives and, when its pool process is lost,
    excuses the delivery of an outside kill before the requeue. Under ``proofline worker`` it also
    notes the message as held until it is acknowledged or rejected (``worker/in_flight.py``), for
    the supervisor to excuse if the whole main process is killed or stopped meanwhile."""

    _oom_at_arrival: int | None = None
    _held_key: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._oom_at_arrival = oom_kills()
        if in_flight.noting():
            self._held_key = deliveries.message_key(self.id, _body_of(self._message))
            in_flight.note(self._held_key, self.name, deliveries.claimed_action_id((self.args,)))

    def acknowledge(self) -> None:
        super().acknowledge()
        if self._held_key is not None:
            in_flight.done(self._held_key)

    def reject(self, requeue: bool = False) -> None:
        super().reject(requeue=requeue)
        if self._held_key is not None:
            in_flight.done(self._held_key)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, WorkerLostError) and self.task.acks_late and self.task.reject_on_worker_lost:
            taken = self._excuse_outside_kill(exit_status(exc))
            try:
                DELIVERIES_LOST.labels(bounded(self.name), taken).inc()
            except Exception:  # noqa: BLE001 - a metric never stops the requeue
                log.debug("deliveries_lost not counted", exc_info=True)
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def _excuse_outside_kill(self, status: int | None) -> str:
        """Excuse the delivery if it was an outside kill; returns how the guard takes the death."""
        if not killed_from_outside(status, self._oom_at_arrival, oom_kills()):
            return "counted"
        key = deliveries.message_key(self.id, _body_of(self._message))
        action_id = deliveries.claimed_action_id((self.args,))
        try:
            row = _main.run(deliveries.excuse, key, self.name, action_id, get_settings().max_excused_deliveries)
        except Exception as exc:  # noqa: BLE001 - not excused: the guard counts the death as before
            log.warning("outside kill not recorded", extra={"event": "delivery_excuse_failed",
                                                             "error": type(exc).__name__})
            return "unrecorded"
        if row is None:
            log.warning("delivery lost to an outside kill counted: the message's excuses are spent",
                        extra={"event": "delivery_excuses_spent", "message_key": key, "action_id": action_id})
            return "spent"
        log.info("delivery lost to an outside kill (exit %s): not counted against the message", status,
                 extra={"event": "delivery_excused", "message_key": key, "action_id": action_id,
                        "excused": row["excused"], "unsettled": row["unsettled"]})
        return "excused"
