"""Processes a test or a soak starts itself: started in their own session, stopped by process
group, and waited on by condition (never by a fixed sleep)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from proofline.settings import ROOT


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05, what: str = "") -> Any:
    """Poll until ``predicate`` returns something truthy; raise AssertionError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(interval)


def gone(proc: psutil.Process) -> bool:
    """Exited or a zombie; a process reaped between the two looks (psutil raises then) counts as gone."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def start_process(argv: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    """``argv`` in a new session (its own process group), output appended to ``log``."""
    with open(log, "ab") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=cwd,
                                start_new_session=True)


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL of the process group we started it in (its children included)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session made proc.pid the group id
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(5)


def stop_group(pgid: int, grace: float = 20.0) -> None:
    """Stop a process group a test started with ``start_new_session=True`` (a shell script and what
    it left running in the background): SIGTERM, then SIGKILL after ``grace`` seconds."""
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
