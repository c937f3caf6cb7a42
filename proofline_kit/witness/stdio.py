"""The stdio relay: starts the server command as its child and copies bytes both ways unchanged.

Each direction is one thread doing blocking reads of whatever arrived (never waiting for a whole
line, so a message is forwarded as fast as without the relay and an oversized one is not held in
memory). Complete lines are parsed on the side and recorded *before* the chunk that completes them
is forwarded: by the time the server can act on a request, its ``call`` record is on disk; by the
time the client sees an answer, its ``result`` record is.

The relay's exit mirrors the server's: the same exit code, or the same signal re-raised, so a
supervisor that reads the exit status (the worker reads bwrap's) sees the server's death.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

from proofline_kit.witness.record import LineSplitter, Observer, RecordWriter, parse

CHUNK = 64 * 1024
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _pump(source: int, sink: int, splitter: LineSplitter, observe: Callable[[object], None]) -> None:
    """Copy ``source`` to ``sink``; once the sink is closed keep draining, recording nothing more
    (nothing read after that point can reach the other side)."""
    sink_open = True
    while True:
        try:
            chunk = os.read(source, CHUNK)
        except OSError:
            chunk = b""
        if not chunk:
            break
        if not sink_open:
            continue
        for line in splitter.feed(chunk):
            message = parse(line)
            if message is not None:
                observe(message)
        try:
            _write_all(sink, chunk)
        except OSError:
            sink_open = False
    try:
        os.close(sink)
    except OSError:
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def relay(command: Sequence[str], log: str, name: str) -> int:
    """Run ``command`` with its stdin/stdout relayed through this process; returns its exit status."""
    writer = RecordWriter(log)
    observer = Observer(writer, name, "stdio")
    child = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    for signo in FORWARDED_SIGNALS:
        signal.signal(signo, lambda s, _f: child.poll() is None and child.send_signal(s))
    lock = threading.Lock()

    def client(message: object) -> None:
        with lock:
            observer.client(message)

    def server(message: object) -> None:
        with lock:
            observer.server(message)

    assert child.stdin is not None and child.stdout is not None
    up = threading.Thread(target=_pump, args=(sys.stdin.fileno(), child.stdin.fileno(), LineSplitter(), client),
                          daemon=True)
    down = threading.Thread(target=_pump, args=(child.stdout.fileno(), sys.stdout.fileno(), LineSplitter(), server),
                            daemon=True)
    up.start()
    down.start()
    code = child.wait()
    down.join(timeout=5.0)  # a grandchild holding the pipe open must not keep the relay alive
    writer.close()
    return code


def exit_like(code: int) -> None:
    """Leave with the child's status: its exit code, or die of the signal that killed it."""
    if code < 0:
        signo = -code
        if signo != signal.SIGKILL:  # SIGKILL has no handler to reset
            signal.signal(signo, signal.SIG_DFL)
        os.kill(os.getpid(), signo)
        code = 128 + signo  # only reached for a signal that does not terminate by default
    os._exit(code)
