"""Running a callable in a forked child of this process, as if it were a new interpreter's main.

A supervisor that starts each run as a new interpreter pays the run's imports every time (the MCP
SDK, Celery, redis, psycopg, pydantic: about 2 CPU-seconds here); a fork of a process that imported
them pays almost nothing, as Celery's own prefork pool shows. A fork copies everything the parent
holds, though: a lock another thread held at that moment stays locked in the child for ever, and a
connection's socket is shared, so the child could speak inside the parent's database session (its
transaction, its advisory locks) or close it. So :func:`forkable` allows a fork only while this
process has one thread and no open socket; the callers start a new interpreter otherwise.

The child ends as an interpreter would: non-daemon threads waited for, ``atexit`` run (only what the
child registered: the parent's exit functions are not its own), streams flushed, ``SystemExit``'s
status. It skips the teardown of every module, which would touch, and so copy, most of the memory
the fork shares.
"""

from __future__ import annotations

import atexit
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable


def set_title(title: str) -> None:
    """What ``ps`` and ``/proc/PID/cmdline`` show for this process (a fork shows its parent's until
    it says otherwise). Best effort: without ``setproctitle`` the parent's stays."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def default_signals() -> None:
    """Every signal this process handles in Python back to an interpreter's defaults (SIGINT raises
    ``KeyboardInterrupt``, the rest their default action; what is ignored stays ignored)."""
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


class ForkedRun:
    """``main`` run in a forked child, seen as a ``subprocess.Popen`` (``pid``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``, ``returncode``); ``env`` is added to the child's
    environment and ``argv`` is its ``sys.argv``."""

    def __init__(self, main: Callable[[], object], argv: list[str], env: dict[str, str],
                 title: str | None = None) -> None:
        self.args = argv
        self.returncode: int | None = None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            set_title(title or " ".join(argv))
            _run_forked(main, argv, env)  # never returns
        self.pid = pid

    def _reaped(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped by a signal handler's poll during this wait
                if self.returncode is None:
                    self.returncode = 255
                return self.returncode
            if pid == self.pid and self.returncode is None:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reaped(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            code = self._reaped(0)
            assert code is not None
            return code
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_forked(main: Callable[[], object], argv: list[str], env: dict[str, str]) -> None:
    """The forked child: the run's signals, environment and argv, then ``main``; it ends as an
    interpreter would (threads waited for, ``atexit``, streams flushed, ``SystemExit``'s status),
    less the teardown of every module, which would copy the memory the fork shares."""
    code = 1
    try:
        default_signals()
        atexit._clear()  # the supervisor's exit functions are not the run's
        os.environ.update(env)
        sys.argv = list(argv)
        main()
        code = 0
    except SystemExit as exc:
        code = exit_status(exc.code)
    except BaseException:  # noqa: BLE001 - what an uncaught exception does to an interpreter
        sys.excepthook(*sys.exc_info())
    finally:
        end(code)


def exit_status(value: object) -> int:
    """The status ``python`` exits with for ``SystemExit(value)`` (a message is printed, status 1)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    try:
        print(value, file=sys.stderr)
    except (OSError, ValueError):
        pass
    return 1


def end(code: int, interrupted: bool = False) -> None:
    """End this forked process as an interpreter ends: non-daemon threads waited for, ``atexit``
    run, streams flushed (and death by SIGINT after an uncaught ``KeyboardInterrupt``)."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        os._exit(code & 0xFF)


def forkable() -> bool:
    """This process holds no other thread and no open socket, so a fork copies no lock held
    elsewhere and no connection (a database session with its locks, a broker channel) into a run."""
    if threading.active_count() != 1:
        return False
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for name in names:
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                return False
        except OSError:
            continue  # the listing's own descriptor, closed by now
    return True
