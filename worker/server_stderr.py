"""What a stdio server writes to stderr, passed on line by line, without one known flood.

A server built on the 1.x MCP SDK answers the current protocol's discovery request by logging the
request's validation failure, about 95 lines (``Failed to validate request: 31 validation errors
for ClientRequest`` and a message per candidate request type), on every new connection, and then
accepts the initialize handshake as usual. The runtime connects again after every restart, so
these lines drowned the worker's log. Here the first such block per server and identity becomes one
warning that says what it is and how to avoid it (``protocol: legacy`` in the servers file); later
blocks are counted (:func:`suppressed`), not printed. Every other line goes to this process's
stderr, prefixed with the server's name.

One pipe and one reader thread per server identity and process (created after fork, on first use).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import TextIO

log = logging.getLogger("proofline.servers")

#: The first line of the 1.x SDK's validation warning and the lines that belong to it.
_HEADER = re.compile(r"Failed to validate request: (\d+) validation errors? for ClientRequest")
_BODY = re.compile(r"^(\s|[A-Z]\w*(Request|Notification)\.[\w.\[\]-]*\s*$)")


@dataclass
class _Sink:
    server: str
    role: str
    writer: TextIO
    #: Validation blocks seen (one per connection that probed the current protocol).
    blocks: int = 0
    #: Lines kept out of the log.
    lines: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, line: str, in_block: bool) -> bool:
        """Handle one line; returns whether a validation block is open after it."""
        header = _HEADER.search(line)
        if header is not None:
            with self.lock:
                self.blocks += 1
                self.lines += 1
                first = self.blocks == 1
            if first:
                log.warning(
                    "server %s (%s) is on an older MCP SDK: it logged %s validation errors for the current "
                    "protocol's discovery request and then accepted the initialize handshake. That warning "
                    "(about 95 lines per connection) is counted, not printed; set `protocol: legacy` for this "
                    "server in the servers file to skip the probe", self.server, self.role, header.group(1),
                    extra={"event": "server_validation_warnings", "server": self.server, "role": self.role})
            return True
        if in_block and _BODY.match(line):
            with self.lock:
                self.lines += 1
            return True
        sys.stderr.write(f"[{self.server}/{self.role}] {line}")
        sys.stderr.flush()
        return False


_sinks: dict[tuple[int, str, str], _Sink] = {}
_guard = threading.Lock()


def errlog_for(server: str, role: str) -> TextIO:
    """The file a stdio server of this identity writes its stderr into (shared by its connections)."""
    key = (os.getpid(), server, role)
    with _guard:
        sink = _sinks.get(key)
        if sink is None:
            read_fd, write_fd = os.pipe()
            os.set_inheritable(read_fd, False)
            sink = _Sink(server, role, os.fdopen(write_fd, "w", buffering=1))
            threading.Thread(target=_pump, args=(read_fd, sink), name=f"stderr-{server}-{role}",
                             daemon=True).start()
            _sinks[key] = sink
    return sink.writer


def _pump(read_fd: int, sink: _Sink) -> None:
    in_block = False
    with os.fdopen(read_fd, "r", errors="replace") as lines:
        for line in lines:
            in_block = sink.take(line, in_block)


def suppressed(server: str, role: str) -> tuple[int, int]:
    """``(connections, lines)`` of validation warnings kept out of the log for this identity."""
    sink = _sinks.get((os.getpid(), server, role))
    if sink is None:
        return 0, 0
    with sink.lock:
        return sink.blocks, sink.lines
