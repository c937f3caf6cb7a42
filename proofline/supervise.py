"""A small supervisor for worker processes: restart on an unexpected exit, forward stop signals.

Celery's worker can die on a broker crash (kombu raises ``AttributeError: 'NoneType' object has
no attribute 'hostname'`` while restoring unacknowledged messages from a Redis that is gone: a
long-standing family of upstream issues). In production a process manager restarts it
(``restart: unless-stopped`` in docker-compose, ``Restart=always`` in systemd); ``proofline worker``
does the same when run bare, so nothing depends on a broker never crashing.

Each run is a child process. Given ``fork_main``, the supervisor forks it from its own memory and
calls ``fork_main`` there (as Celery's prefork pool starts its pool processes), instead of starting
a new interpreter from ``argv``: the libraries the supervisor imported (``worker/preload.py``'s
``LIBRARIES``: MCP SDK, Celery, redis, psycopg, pydantic) are not imported again, so a run starts,
and a crashed worker is back, in a fraction of the time (about 0.2 CPU-seconds to reach Celery's
start instead of 2, measured by ``python -m ops.worker_start_bench``). It forks only while it holds
no other thread and no open socket, so that no lock, connection or session of its own is copied
into the run; otherwise, and always without ``fork_main``, it starts ``argv``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Protocol

from worker.forking import ForkedRun, forkable

log = logging.getLogger(__name__)


#: An exit this soon after start is an early exit: the worker never got going.
EARLY_EXIT_SECONDS = 5.0
#: This many early exits in a row is a configuration error, not bad luck: stop and say so.
EARLY_EXITS_LIMIT = 3
#: A run this long resets the backoff: the worker was healthy, the exit is a new incident.
HEALTHY_RUN_SECONDS = 60.0
CONFIGURATION_ERROR_EXIT = 78  # EX_CONFIG


class RunHooks(Protocol):
    """What a caller adds around each run (``worker/in_flight.py``'s held messages)."""

    def env(self) -> dict[str, str]:
        """Extra environment for the next run, read just before it starts."""

    def ended(self, code: int) -> object:
        """The run ended with ``code`` (negative: killed by that signal), before any restart."""


def supervise(argv: list[str], *, max_restarts: int = 100, backoff_seconds: float = 1.0,
              max_backoff_seconds: float = 30.0, early_exit_seconds: float = EARLY_EXIT_SECONDS,
              early_exits_limit: int = EARLY_EXITS_LIMIT, hooks: RunHooks | None = None,
              fork_main: Callable[[], object] | None = None) -> int:
    """Run ``argv`` until it exits cleanly or is told to stop; restart it otherwise, with exponential
    backoff (reset after a healthy run), and give up at once on repeated early exits. ``hooks``
    are told about each run (a failing hook is logged and never stops the supervisor). With
    ``fork_main``, a run is a fork of this process calling it (see the module's docstring)."""
    stopping = False
    child: subprocess.Popen | ForkedRun | None = None

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    restarts = streak = early = 0
    while True:
        started = time.monotonic()
        extra = hooks.env() if hooks is not None else {}
        if fork_main is not None and forkable():
            child = ForkedRun(fork_main, argv, extra)
        else:
            child = subprocess.Popen(argv, env={**os.environ, **extra} if hooks is not None else None)
        print(f"proofline: worker started (pid {child.pid})", file=sys.stderr, flush=True)
        code = child.wait()
        ran = time.monotonic() - started
        if hooks is not None:
            try:
                hooks.ended(code)
            except Exception:  # noqa: BLE001 - what a hook records never decides a restart
                log.warning("a supervisor hook failed after the run ended", exc_info=True,
                            extra={"event": "supervisor_hook_failed"})
        if stopping or code == 0:
            return code
        early = early + 1 if ran < early_exit_seconds else 0
        if early >= early_exits_limit:
            print(f"proofline: worker exited {code} within {early_exit_seconds:g} s of starting {early} times in "
                  "a row; this is a configuration or environment error (broker, database, settings), not a "
                  "crash to restart through. Giving up.", file=sys.stderr, flush=True)
            return code if code > 0 else CONFIGURATION_ERROR_EXIT
        streak = 0 if ran >= HEALTHY_RUN_SECONDS else streak
        restarts += 1
        streak += 1
        if restarts > max_restarts:
            print(f"proofline: worker exited {code}; giving up after {max_restarts} restarts", file=sys.stderr)
            return code if code > 0 else 1
        delay = min(backoff_seconds * 2 ** (streak - 1), max_backoff_seconds)
        print(f"proofline: worker exited {code} after {ran:.1f} s; restarting in {delay:g} s "
              f"({restarts}/{max_restarts})", file=sys.stderr, flush=True)
        time.sleep(delay)
