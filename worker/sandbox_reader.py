"""The reader of one audited sandbox's strace output, and the accounting that keeps it honest.

strace (worker/sandbox.py::launch) writes every failed traced syscall to a FIFO in a private
folder of the worker's; :class:`Auditor` reads it on its own thread and classifies each line
(worker/sandbox_audit.py). Three rules keep the audit from under-reporting silently:

- **Nothing is skipped while the session lives.** A reader that falls behind does not drop lines:
  the FIFO fills and strace waits for it, and the traced server waits for strace (a flood of denied
  syscalls slows the server that makes it, never the count). Repeated lines cost one classification
  (:func:`worker.sandbox_audit.context_free`), so the reader keeps pace with strace.
- **The output is read to its end before the session goes.** :meth:`Auditor.finish` reads until
  strace closes its end (it does once the server has exited), so a session dropped mid-flood (a
  call that timed out) still counts every line, and strace never writes into a closed pipe.
- **What is lost is said.** Lines the reader could not take (a line longer than :data:`MAX_LINE`,
  or output left unread because strace did not finish within the drain time) make an overflow
  record, ``sandbox_audit_overflow``, with the counts: lines seen, lines dropped, violations
  counted, bytes left unread. It is recorded on the action in flight; the server's policy
  (``sandbox.audit.on_overflow``) may fail that call closed (worker/mcp_client.py).

The folder carries the worker process's pid in its name (``proofline-audit-<pid>-…``), so a worker
that was killed before it could remove it leaves a folder :func:`reap_orphans` recognises.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import shutil
import struct
import tempfile
import termios
import threading
import time
from collections.abc import Callable
from typing import Any

from worker.sandbox import AUDIT_MARKER, Roots
from worker.sandbox_audit import classify, context_free, parse, paths

#: Event of an audit that lost lines (or left some unread); also its ``kind`` in a take.
OVERFLOW_EVENT = "sandbox_audit_overflow"
#: Violations kept per session between two takes; more are counted and summarised.
MAX_KEPT = 64
#: Longest line the reader keeps (strace's, with ``-s 4096`` strings in hex, stay well under it).
MAX_LINE = 64 * 1024
#: Verdicts of context-free lines remembered between two takes (then forgotten: the host may change).
MAX_CACHED = 4096
OPEN_WAIT_SECONDS = 0.5
#: Prefixes of the per-session files a worker keeps in the temporary folder (audit FIFO folder,
#: bwrap status file); each is followed by the owning process's pid and a dash.
OWNED_PREFIXES = ("proofline-audit-", "proofline-sandbox-", "proofline-host-")
_OWNED = re.compile(r"^(?:proofline-audit-|proofline-sandbox-|proofline-host-)(\d+)-")


def owned_prefix(kind: str) -> str:
    """The temporary-file prefix for one of this process's session files (``audit`` or ``sandbox``)."""
    return f"proofline-{kind}-{os.getpid()}-"


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def reap_orphans(folder: str | None = None) -> list[str]:
    """Remove the session files of worker processes that are gone (killed before they could clean
    up); returns what was removed. Files of live processes, and names without a pid, are left."""
    folder = folder or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        m = _OWNED.match(name)
        if m is None or int(m.group(1)) == os.getpid() or alive(int(m.group(1))):
            continue
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                continue
        removed.append(path)
    return removed


def _unread(fd: int) -> int:
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


class Auditor:
    """Reads one audited sandbox's strace output (a FIFO) and keeps the violations it finds.

    A thread drains the FIFO; :meth:`take` first reads whatever is already written (strace writes
    a line before the traced process continues, so by the time the server has answered a call
    every failure of that call is in the FIFO) and then hands over what was found since the last
    take. ``on_violation`` runs for each violation kept (logging); ``counted`` with the number of
    violations each read found, kept or not (metrics)."""

    def __init__(self, server: str, role: str, on_violation: Callable[[dict[str, Any]], None] | None = None,
                 counted: Callable[[int], None] | None = None) -> None:
        self.server, self.role = server, role
        self.on_violation = on_violation
        self.counted = counted
        self.roots = Roots()
        self.directory = tempfile.mkdtemp(prefix=owned_prefix("audit"))  # mode 0700, the worker's only
        self.path = os.path.join(self.directory, "trace")
        os.mkfifo(self.path, 0o600)
        self.armed = False
        #: Lines read, lines dropped, violations counted, over the session's life.
        self.lines = self.dropped = self.total = 0
        self.unread = 0
        self._found: list[dict[str, Any]] = []
        self._suppressed = 0
        self._overflow: str | None = None  # why lines were lost since the last take
        self._cache: dict[str, dict[str, Any] | None] = {}
        self._buffer = b""
        self._skipping = False
        self._fd: int | None = None
        self._eof = False
        self._stop = threading.Event()
        self._opened = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # close() wakes the reader at once
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._drain, name=f"audit-{server}-{role}", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)  # returns once strace opens its end (or close() does)
        except OSError:
            return
        os.set_blocking(fd, False)
        with self._lock:
            self._fd = fd
        self._opened.set()
        while not self._stop.is_set() and not self._eof:
            ready, _, _ = select.select([fd, self._wake_r], [], [])
            if fd in ready:
                self.settle()

    @property
    def ended(self) -> bool:
        """Whether strace's output was read to its end."""
        return self._eof

    def settle(self) -> None:
        """Read and classify everything strace has written so far."""
        if not self._opened.is_set():
            # strace opens the FIFO as it starts, long before a session is ready; this only waits
            # out the instant between the reader's open returning and it publishing the descriptor.
            self._opened.wait(OPEN_WAIT_SECONDS)
        with self._lock:
            while self._fd is not None and not self._eof:
                try:
                    chunk = os.read(self._fd, 65536)
                except BlockingIOError:
                    return
                if not chunk:
                    self._eof = True
                    return
                self._feed(chunk)

    def _feed(self, chunk: bytes) -> None:
        if self._skipping:
            # The rest of a line dropped for its length: never parsed as a line of its own.
            end = chunk.find(b"\n")
            if end < 0:
                return
            chunk, self._skipping = chunk[end + 1:], False
        lines = (self._buffer + chunk).split(b"\n")
        self._buffer = lines.pop()
        if len(self._buffer) > MAX_LINE:
            self.lines += 1
            self._lost(1, "line_too_long")  # not a line strace writes; drop it rather than grow
            self._buffer, self._skipping = b"", True
        found = 0
        for raw in lines:
            self.lines += 1
            if len(raw) > MAX_LINE:
                self._lost(1, "line_too_long")
                continue
            verdict = self._classify(raw.decode("ascii", "replace"))
            if verdict is None:
                continue
            found += 1
            verdict = {"server": self.server, "role": self.role, **verdict}
            if len(self._found) < MAX_KEPT:
                self._found.append(verdict)
                if self.on_violation is not None:
                    self.on_violation(verdict)
            else:
                self._suppressed += 1
        self.total += found
        if found and self.counted is not None:
            self.counted(found)

    def _classify(self, text: str) -> dict[str, Any] | None:
        pid, _, rest = text.partition(" ")
        if self.armed and rest in self._cache:
            cached = self._cache[rest]
            return None if cached is None else {**cached, "pid": int(pid)}
        record = parse(text)
        if record is None:
            return None
        if not self.armed:
            self.armed = any(p == AUDIT_MARKER for p, _ in paths(record))
            return None
        verdict = classify(record, self.roots)
        if context_free(record):
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()
            self._cache[rest] = verdict
        return verdict

    def _lost(self, count: int, why: str) -> None:
        self.dropped += count
        self._overflow = self._overflow or why

    def overflow(self) -> dict[str, Any] | None:
        """The overflow record to keep now (lines lost or left unread since the last take), or None."""
        if self._overflow is None:
            return None
        return {"_event": OVERFLOW_EVENT, "kind": "audit_overflow", "server": self.server, "role": self.role,
                "reason": self._overflow, "lines_seen": self.lines, "lines_dropped": self.dropped,
                "violations": self.total, "unread_bytes": self.unread}

    def take(self) -> list[dict[str, Any]]:
        """The violations found since the last take (past :data:`MAX_KEPT`, one summary entry), and
        the overflow record when lines were lost."""
        self.settle()
        with self._lock:
            out, self._found = self._found, []
            if self._suppressed:
                out.append({"server": self.server, "role": self.role, "kind": "suppressed", "count": self._suppressed})
                self._suppressed = 0
            lost = self.overflow()
            if lost is not None:
                out.append(lost)
                self._overflow = None
            self._cache.clear()
        return out

    def finish(self, timeout: float) -> bool:
        """Read strace's output to its end (strace closes it once the server has exited), for up to
        ``timeout`` seconds; what is left unread then is an overflow. True when the end was read."""
        deadline = time.monotonic() + timeout
        while True:
            self.settle()
            if self._eof or self._fd is None:
                return self._eof or not self._opened.is_set()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            select.select([self._fd], [], [], min(left, 0.05))
        with self._lock:
            if self._fd is not None and not self._eof:
                self.unread = _unread(self._fd)
                self._overflow = self._overflow or "closed_before_end"
        return False

    def close(self) -> None:
        if self._stop.is_set():
            return  # closed already
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._fd is None:
            try:  # unblock a reader still waiting for strace to open the FIFO
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        self._thread.join(timeout=2)
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        os.close(self._wake_r)
        os.close(self._wake_w)
        shutil.rmtree(self.directory, ignore_errors=True)
