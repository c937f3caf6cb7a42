"""A pool process's side of the node's session host (worker/session_host.py).

:func:`borrow` checks out a server for one stdio identity on a control connection and returns the
:class:`Loan`; :func:`host_stdio_client` is the MCP transport over the loan's data connection (its
messages bounded as ``worker/bounded_stdio.py`` bounds a server's pipe); :class:`RemoteAudit` is
the audit the session takes its findings from, read by the host. Where there is no host (the
setting is off, the worker was started without one, the host is gone), :func:`borrow` returns None
and the session launches its own server as before: the host saves starts, it is never required.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from mcp.shared.message import SessionMessage

from proofline.errors import McpUnavailable
from worker.bounded_stdio import _Line, pumping, split_lines
from worker.servers import Endpoint

log = logging.getLogger(__name__)

#: Where the worker's main process tells its pool processes the host listens.
SOCKET_ENV = "PROOFLINE_SESSION_HOST_SOCKET"
#: How long a control request may take (a checkout may start a server: bwrap, strace, the interpreter).
CONTROL_TIMEOUT_SECONDS = 30.0
MAX_ANSWER_BYTES = 8 << 20
_warned = False


def socket_path() -> str | None:
    path = os.environ.get(SOCKET_ENV)
    return path if path and os.path.exists(path) else None


class Loan:
    """One server lent to this process: the control connection it was checked out on."""

    def __init__(self, path: str, spec: dict[str, Any]) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(CONTROL_TIMEOUT_SECONDS)
        self._sock.connect(path)
        self._file = self._sock.makefile("rb")
        self.ended = False
        answer = self.request("checkout", spec=spec)
        self.lease: str = answer["lease"]
        self.id_base: int = int(answer["id_base"])
        self.status_path: str | None = answer.get("status_path")
        self.audited: bool = bool(answer.get("audited"))
        self.pid: int = int(answer["pid"])
        self.loan: int = int(answer.get("loan", 1))

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            if self.ended:
                raise McpUnavailable(f"session host: {op} after the loan ended")
            try:
                self._sock.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
                raw = self._file.readline(MAX_ANSWER_BYTES)
            except OSError as exc:
                self._close()
                raise McpUnavailable(f"session host: {op} failed: {exc}") from None
            answer = json.loads(raw) if raw.endswith(b"\n") else None
            if not isinstance(answer, dict):
                self._close()
                raise McpUnavailable(f"session host: no answer to {op}")
            if not answer.get("ok"):
                raise McpUnavailable(f"session host refused {op}: {answer.get('error')}")
            return answer

    def end(self, retire: bool, drain_seconds: float = 0.0) -> tuple[list[dict[str, Any]], int]:
        """Give the server back (``retire``: have it stopped and its audit read to the end). Returns
        the audit's findings and count since the last take; nothing when the loan had ended."""
        if self.ended:
            return [], 0
        try:
            answer = self.request("retire" if retire else "release", drain_seconds=drain_seconds)
        except McpUnavailable:
            return [], 0
        finally:
            self._close()
        return list(answer.get("found") or []), int(answer.get("counted") or 0)

    def _close(self) -> None:
        self.ended = True
        try:
            self._file.close()
            self._sock.close()
        except OSError:
            pass


def borrow(endpoint: Endpoint, server: str, role: str, base_dir: Path, environment: str,
           max_message_bytes: int) -> Loan | None:
    """A server for this stdio identity from the node's host, or None (no host: launch your own)."""
    global _warned
    path = socket_path()
    if path is None or endpoint.transport != "stdio":
        return None
    spec = {"server": server, "role": role, "endpoint": endpoint.model_dump(mode="json", exclude_unset=True),
            "base_dir": str(base_dir), "environment": environment, "max_message_bytes": max_message_bytes}
    try:
        return Loan(path, spec)
    except (OSError, ValueError, KeyError, McpUnavailable) as exc:
        if not _warned:
            _warned = True
            log.warning("session host unavailable; this process starts its own servers: %s", exc,
                        extra={"event": "session_host_unavailable", "server": server, "role": role})
        return None


class RemoteAudit:
    """The audit of a lent server, as a session uses an :class:`worker.sandbox_reader.Auditor`."""

    def __init__(self, loan: Loan, counted: Any) -> None:
        self.loan = loan
        self.armed = False
        self._counted = counted
        self._kept: list[dict[str, Any]] = []

    def settle(self) -> None:
        if not self.loan.ended:
            self.armed = bool(self.loan.request("settle").get("armed"))

    def take(self) -> list[dict[str, Any]]:
        kept, self._kept = self._kept, []
        if self.loan.ended:
            return kept
        answer = self.loan.request("take")
        self._count(int(answer.get("counted") or 0))
        return kept + list(answer.get("found") or [])

    def end(self, retire: bool, drain_seconds: float) -> None:
        found, counted = self.loan.end(retire, drain_seconds)
        self._kept.extend(found)
        self._count(counted)

    def finish(self, timeout: float) -> bool:
        self.end(True, timeout)
        return True

    def close(self) -> None:
        self.end(True, 0.0)

    def _count(self, n: int) -> None:
        if n and self._counted is not None:
            self._counted(n)


@asynccontextmanager
async def host_stdio_client(loan: Loan, max_message_bytes: int) -> AsyncGenerator:
    """An MCP transport over the loan's data connection (``mcp.Client`` takes it as a stdio one)."""
    stream = await anyio.connect_unix(loan.path)
    await stream.send(json.dumps({"attach": loan.lease}).encode() + b"\n")
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)
    gone = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError)

    async def reader() -> None:
        line = _Line(max_message_bytes)
        async with read_writer:
            try:
                async for chunk in stream:
                    done, line = split_lines(chunk, line)
                    for complete in done:
                        message = complete.finish()
                        if message is not None:
                            await read_writer.send(message)
            except gone:
                pass  # the host closed it (the server ended) or we are shutting down

    async def writer() -> None:
        async with write_reader:
            try:
                async for message in write_reader:
                    body = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await stream.send(body.encode() + b"\n")
            except gone:
                await read_writer.aclose()

    async def shutdown() -> None:
        read_stream.close()
        write_stream.close()
        await stream.aclose()

    async with pumping(reader, writer, shutdown):
        yield read_stream, write_stream
