"""Lines of JSON-RPC read from a byte stream, never holding more than a bounded message.

Shared by the stdio transports (worker/bounded_stdio.py, worker/host_client.py) and the node's
session host (worker/session_host.py), which relays lines without parsing them as MCP messages and so
has no need of the SDK: keeping this module free of it keeps the SDK's import (most of an
interpreter's start) out of the host's process.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import TypeVar

#: JSON-RPC error code (implementation-defined server error range) for an oversize message.
MESSAGE_TOO_LARGE = -32077
EXCERPT_BYTES = 1024
_ID = re.compile(rb'"id"\s*:\s*("(?:[^"\\]|\\.){0,200}"|-?\d{1,20})')


class Line:
    """One line being read: kept while small, then only hashed and counted."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0
        self.digest: hashlib._Hash | None = None
        self.head = b""

    def add(self, data: bytes) -> None:
        self.size += len(data)
        if self.digest is not None:
            self.digest.update(data)
            return
        self.parts.append(data)
        if self.size > self.limit:
            joined = b"".join(self.parts)
            self.head, self.parts = joined[:4096], []
            self.digest = hashlib.sha256(joined)

    def raw(self) -> bytes | None:
        """The line as it came (within the limit), or in place of an oversize one the JSON-RPC error
        for its request id; None for an oversize line whose id cannot be read."""
        if self.digest is None:
            return b"".join(self.parts)
        found = _ID.search(self.head)
        if found is None:
            return None
        error = {"jsonrpc": "2.0", "id": json.loads(found.group(1)), "error": {
            "code": MESSAGE_TOO_LARGE,
            "message": f"message of {self.size} bytes exceeds the limit of {self.limit}",
            "data": {"size": self.size, "sha256": self.digest.hexdigest(), "limit": self.limit,
                     "excerpt": self.head[:EXCERPT_BYTES].decode("utf-8", errors="replace")}}}
        return json.dumps(error).encode()


L = TypeVar("L", bound=Line)


def split_lines(chunk: bytes, line: L) -> tuple[list[L], L]:
    """The lines ``chunk`` completes (``line`` first) and the line it leaves open (of ``line``'s class)."""
    done: list[L] = []
    start = 0
    while True:
        end = chunk.find(b"\n", start)
        if end < 0:
            if start < len(chunk):
                line.add(chunk[start:])
            return done, line
        line.add(chunk[start:end])
        start = end + 1
        done.append(line)
        line = type(line)(line.limit)
