"""One timer thread per worker process for the periodic jobs of an action in flight.

A lease's session keeper and its heartbeat each ran on a thread of their own, started and joined
for every action. On the fast path neither ever fires (an action takes milliseconds, the period is
seconds), so those threads were pure cost: two thread starts and two joins per action, each join
waiting for the stopped thread to be scheduled. Here a job is an entry in a table read by one
long-lived thread per process (made lazily, again after a fork), so starting and stopping a job is
a few dictionary operations under a lock.

Semantics kept from the threads they replace:

- a job runs ``interval`` seconds after it was started, then ``interval`` seconds after each run
  ended (never two runs of one job at once);
- :meth:`Job.stop` returns only when the job is not running and will never run again, so the
  caller may use what the job used (the lease's connection) as soon as it returns;
- a job that returns ``False`` is not run again (it decided it is finished, for example because
  the session it keeps is gone).

Jobs of one process run one after another on the thread: in a prefork child one action runs at a
time, and its jobs share its database connection, which serialises them anyway.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Job:
    """A periodic call on the process's timer thread; stop it with :meth:`stop`."""

    def __init__(self, timer: Timer, job_id: int, interval: float, fn: Callable[[], bool | None], name: str) -> None:
        self.timer, self.job_id, self.interval, self.fn, self.name = timer, job_id, interval, fn, name
        self.due = time.monotonic() + interval
        #: Held while the job runs: :meth:`stop` takes it to wait for a run in progress.
        self.running = threading.Lock()
        self.stopped = False

    def stop(self, timeout: float | None = None) -> bool:
        """Never run this job again; wait (up to ``timeout``) for a run in progress to end.
        Returns False only when that wait timed out. Not for use from inside the job itself."""
        self.timer.forget(self)
        acquired = self.running.acquire(timeout=-1 if timeout is None else timeout)
        if acquired:
            self.running.release()
        return acquired


class Timer:
    """The table of jobs and the thread that runs them when due."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)
        self._wake_at = float("inf")
        self._thread: threading.Thread | None = None

    def every(self, interval: float, fn: Callable[[], bool | None], name: str = "job") -> Job:
        """Run ``fn`` every ``interval`` seconds from now until the job is stopped or ``fn`` returns False."""
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="proofline-timer", daemon=True)
                self._thread.start()
            job = Job(self, next(self._ids), interval, fn, name)
            self._jobs[job.job_id] = job
            # The thread sleeps until its earliest job is due: wake it only if this one is earlier.
            if job.due < self._wake_at:
                self._cond.notify()
        return job

    def forget(self, job: Job) -> None:
        with self._cond:
            job.stopped = True
            self._jobs.pop(job.job_id, None)

    def after_fork_in_child(self) -> None:
        """A forked child inherits the table but not the thread (nor a lock the parent's thread held):
        the parent's jobs are not its own."""
        self._cond = threading.Condition()
        self._jobs = {}
        self._wake_at = float("inf")
        self._thread = None

    def _loop(self) -> None:
        cond = self._cond
        while True:
            with cond:
                now = time.monotonic()
                due = [job for job in self._jobs.values() if job.due <= now]
                if not due:
                    self._wake_at = min((job.due for job in self._jobs.values()), default=float("inf"))
                    cond.wait(None if self._wake_at == float("inf") else self._wake_at - now)
                    continue
            for job in due:
                self._run(job)

    def _run(self, job: Job) -> None:
        with job.running:
            if job.stopped:
                return
            try:
                again = job.fn() is not False
            except Exception:  # noqa: BLE001 - one job's failure must not stop the others
                log.exception("periodic job failed", extra={"event": "timer_job_failed", "job": job.name})
                again = False
            with self._cond:
                if again and not job.stopped:
                    job.due = time.monotonic() + job.interval
                else:
                    job.stopped = True
                    self._jobs.pop(job.job_id, None)


_TIMER = Timer()
os.register_at_fork(after_in_child=_TIMER.after_fork_in_child)


def every(interval: float, fn: Callable[[], bool | None], name: str = "job") -> Job:
    """Run ``fn`` every ``interval`` seconds on this process's timer thread (see :class:`Timer`)."""
    return _TIMER.every(interval, fn, name)
