"""Processes a test or a soak starts itself: started in their own session, stopped by process
group, and waited on by condition (never by a fixed sleep).

A process in its own session does not get the terminal's signals, so it would outlive the test run
that started it: every group started here is *owned* (:func:`own`) and killed when this process
exits (atexit) or is told to stop (SIGTERM, SIGHUP, SIGINT: the groups go first, then the signal's
usual course). A test run stopped by its runner leaves no worker, beat, server or broker behind.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from proofline.settings import ROOT


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05,
             what: str | Callable[[], str] = "") -> Any:
    """Poll until ``predicate`` returns something truthy; raise AssertionError naming ``what``
    otherwise. A callable ``what`` is asked at the timeout, so the message tells where things stood
    when the wait gave up, not when it began."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {(what() if callable(what) else what) or predicate}")
        time.sleep(interval)


def gone(proc: psutil.Process) -> bool:
    """Exited or a zombie; a process reaped between the two looks (psutil raises then) counts as gone."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


#: Process groups this process started and has not stopped yet, by group id (the leader's pid).
_owned: dict[int, subprocess.Popen] = {}
_owned_lock = threading.Lock()
_handlers_installed = False
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def own(proc: subprocess.Popen) -> subprocess.Popen:
    """Kill ``proc``'s process group (started with ``start_new_session=True``) when this process
    exits or is stopped by a signal, unless it was stopped before. Returns ``proc``."""
    global _handlers_installed
    with _owned_lock:
        _owned[proc.pid] = proc
        install = not _handlers_installed and threading.current_thread() is threading.main_thread()
        if install:
            _handlers_installed = True
    if install:
        atexit.register(kill_owned)
        for sig in STOP_SIGNALS:
            previous = signal.getsignal(sig)
            signal.signal(sig, lambda signum, frame, previous=previous: _stopped(signum, frame, previous))
    return proc


def _disown(pgid: int) -> None:
    with _owned_lock:
        _owned.pop(pgid, None)


def kill_owned() -> None:
    """SIGKILL every owned process group that is still there (each child's own children included)."""
    with _owned_lock:
        groups, _owned_copy = list(_owned), dict(_owned)
        _owned.clear()
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in _owned_copy.values():
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _stopped(signum: int, frame: object, previous: object) -> None:
    kill_owned()
    if callable(previous):
        previous(signum, frame)  # pytest's own SIGINT handling, for one
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def start_process(argv: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    """``argv`` in a new session (its own process group, owned: see :func:`own`), output appended to
    ``log``; a Python process is forked from the test process's zygote (``proofline_kit/zygote.py``)."""
    from proofline_kit.zygote import spawn

    with open(log, "ab") as handle:  # the child keeps its own copy of the descriptor
        return own(spawn(argv, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True))


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL of the process group we started it in (its children included)."""
    stop_processes([proc], grace)


def stop_processes(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """:func:`stop_process` for several at once: every one is sent SIGTERM first, so that their
    clean shutdowns overlap instead of following one another; then each is given what is left of
    ``grace`` (counted from the signal) and its process group is killed."""
    deadline = time.monotonic() + grace
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # start_new_session made proc.pid the group id
        except (ProcessLookupError, PermissionError):
            pass
        if proc.poll() is None:
            proc.wait(5)
        _disown(proc.pid)
    for proc in procs:
        # SIGKILL is delivered, not awaited: a member of the group (a supervised Celery worker under
        # its supervisor) can still hold its connections for a moment, long enough for a caller
        # counting the broker's consumers next to count the dying one (a replacement worker was then
        # never seen to consume, on a loaded machine).
        # Bounded, and never an error here: a stop is also a teardown, which must not fail a test.
        until = time.monotonic() + 10
        while group_members(proc.pid) and time.monotonic() < until:
            time.sleep(0.02)


def group_members(pgid: int) -> list[psutil.Process]:
    """The processes of group ``pgid`` that still run (zombies have closed what they held)."""
    members = []
    for candidate in psutil.process_iter():
        try:
            if os.getpgid(candidate.pid) == pgid and not gone(candidate):
                members.append(candidate)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


def stop_group(pgid: int, grace: float = 20.0) -> None:
    """Stop a process group a test started with ``start_new_session=True`` (a shell script and what
    it left running in the background): SIGTERM, then SIGKILL after ``grace`` seconds."""
    _disown(pgid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def unused_port() -> int:
    """A loopback port that was free a moment ago, for a server that cannot bind port 0 and report
    it (redis-server, RabbitMQ): the caller tries it and checks that the server answering is its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_port(port: int, timeout: float = 20.0) -> None:
    wait_for(lambda: port_answers(port), timeout, what=f"port {port}")


def wait_port_file(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """The port a process we started bound itself (port 0) and wrote to ``path``; fails early when
    the process exits first."""
    def reported() -> int | None:
        if path.exists():
            text = path.read_text().strip()
            return int(text) if text else None
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before reporting its port")
        return None

    port = wait_for(reported, timeout, what=f"a port in {path}")
    wait_port(port, timeout)
    return port


class OwnedServer:
    """A broker process a test owns and may kill: ``start()`` picks a port (a restart reuses it),
    ``kill()`` ends it without a clean shutdown, ``stop()`` ends it for good."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def accepted(self, proc: subprocess.Popen) -> bool:
        """``proc`` is the server answering on our port: keep it."""
        self.proc = proc
        self.starts += 1
        return True

    def stop(self, grace: float = 5.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace=grace)
