"""Starting, watching and stopping the node's session host (worker/session_host.py) from the
worker's main process.

The main process starts the host before it forks its pool processes and tells them where it listens
(``PROOFLINE_SESSION_HOST_SOCKET``, inherited). The host runs under the same parent-death signal as
an audit's tracer (worker/deathsig.py): it dies with the main process, and its servers and tracers
die with it (bubblewrap's ``--die-with-parent``, strace's own parent-death signal). A host that
exits while the worker runs is started again on the same socket by a watcher thread (backing off
from one second to thirty between failed starts); meanwhile pool processes start their own
servers. Its socket is in a folder of mode 0700 named after the main process's pid, which the
sandbox reaper removes once that process is gone; the audit folders of a host that was killed are
removed by the watcher before it starts the next one.
"""

from __future__ import annotations

import functools
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from worker.forking import ForkedRun, forkable
from worker.host_client import SOCKET_ENV
from worker.sandbox import DEATHSIG
from worker.sandbox_reader import owned_prefix, reap_orphans

log = logging.getLogger(__name__)
READY_SECONDS = 30.0
STOP_SECONDS = 10.0
WATCH_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0

_host: subprocess.Popen[bytes] | ForkedRun | None = None
_folder: str | None = None
_stopping = threading.Event()
_watcher: threading.Thread | None = None


def _launch(path: str, spares: int) -> subprocess.Popen[bytes] | ForkedRun | None:
    """Start a host on ``path``; None when it did not become ready within :data:`READY_SECONDS`."""
    try:
        os.unlink(path)  # a previous host's socket
    except FileNotFoundError:
        pass
    ready_r, ready_w = os.pipe()
    args = ["--socket", path, "--spares", str(spares), "--ready-fd", str(ready_w)]
    try:
        host: subprocess.Popen[bytes] | ForkedRun
        if forkable():  # the main process before its pool, with the worker's modules loaded: fork it
            host = ForkedRun(functools.partial(_forked_host, os.getpid(), args), ["worker.session_host", *args], {},
                             title=" ".join([sys.executable, "-m", "worker.session_host", *args]))
        else:
            host = subprocess.Popen([sys.executable, "-I", "-S", DEATHSIG, str(os.getpid()), sys.executable, "-m",
                                     "worker.session_host", *args], pass_fds=(ready_w,), stdin=subprocess.DEVNULL)
    except OSError as exc:
        os.close(ready_r)
        os.close(ready_w)
        log.warning("session host did not start: %s", exc, extra={"event": "session_host_unavailable"})
        return None
    os.close(ready_w)
    ready, _, _ = select.select([ready_r], [], [], READY_SECONDS)
    answer = os.read(ready_r, 64) if ready else b""
    os.close(ready_r)
    if not answer.startswith(b"ready"):
        host.kill()
        host.wait()
        log.warning("session host did not become ready", extra={"event": "session_host_unavailable"})
        return None
    log.info("session host ready", extra={"event": "session_host_ready", "pid": host.pid, "socket": path})
    return host


def _forked_host(parent: int, args: list[str]) -> None:
    """The host in a fork of the worker's main process, set up as its own start would set it up:
    killed with its parent (as ``worker/deathsig.py`` does for a started one), standard input from
    /dev/null, the real standard streams (not Celery's logging proxies) and its own logging."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        os._exit(126)
    if os.getppid() != parent:
        os._exit(125)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    from worker.session_host import main

    main(args)


def _watch(path: str, spares: int) -> None:
    # This thread starts every replacement and lives as long as the host it started: the parent-death
    # signal fires when the thread that forked the host ends, not only the process.
    global _host
    backoff = WATCH_SECONDS
    while not _stopping.wait(backoff if _host is None else WATCH_SECONDS):
        host = _host
        if host is not None and host.poll() is None:
            backoff = WATCH_SECONDS
            continue
        if host is not None:
            # A killed host could not remove its servers' audit folders; its pid is now free of them.
            removed = reap_orphans()
            log.warning("session host exited (%s); starting another", host.returncode,
                        extra={"event": "session_host_exited", "returncode": host.returncode,
                               "sandbox_files_reaped": len(removed)})
        _host = _launch(path, spares)
        backoff = WATCH_SECONDS if _host is not None else min(BACKOFF_MAX_SECONDS, backoff * 2)


def start(spares: int) -> str | None:
    """Start the host and its watcher; return the socket's path (None when the first host did not
    become ready: the pool processes then start their own servers, and the watcher keeps trying)."""
    global _host, _folder, _watcher
    _stopping.clear()
    _folder = tempfile.mkdtemp(prefix=owned_prefix("host"))
    path = os.path.join(_folder, "sessions.sock")
    _host = _launch(path, spares)
    os.environ[SOCKET_ENV] = path
    _watcher = threading.Thread(target=_watch, args=(path, spares), name="session-host-watch", daemon=True)
    _watcher.start()
    return path if _host is not None else None


def stop() -> None:
    """Stop the watcher and the host (its servers end with it) and remove its folder."""
    global _host, _folder, _watcher
    _stopping.set()
    if _watcher is not None:
        _watcher.join(READY_SECONDS + STOP_SECONDS)
    host, folder, _host, _folder, _watcher = _host, _folder, None, None, None
    os.environ.pop(SOCKET_ENV, None)
    if host is not None and host.poll() is None:
        host.send_signal(signal.SIGTERM)
        try:
            host.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            host.kill()
            host.wait()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
