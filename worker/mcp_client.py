"""MCP sessions kept per worker process and reused across tasks.

Spawning a stdio server costs ~700 ms and a new HTTP client ~30 ms, so each pool child keeps one
session per (server, identity) open. anyio requires a client context to be entered and exited
by the same task, so each session lives in its own task on a blocking portal (an event-loop
thread created lazily *after* fork, in the process that uses it); tasks hand it coroutines to run.
A session that dies (server killed, connection lost) is replaced on the next call.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal
from mcp import Client, StdioServerParameters

from proofline.errors import McpUnavailable
from worker.bounded_stdio import bounded_stdio_client
from worker.servers import Endpoint, Server

T = TypeVar("T")
Role = Literal["write", "read"]
CONNECT_TIMEOUT_SECONDS = 15.0


def endpoint_target(endpoint: Endpoint, base_dir: Path, max_message_bytes: int | None = None) -> Any:
    """What ``mcp.Client`` connects to: a URL, or a stdio command with an explicit environment (read
    through a transport that bounds every message to ``max_message_bytes``, when given)."""
    if endpoint.transport == "http":
        return endpoint.url
    argv = endpoint.argv()
    params = StdioServerParameters(
        command=argv[0], args=argv[1:], env=endpoint.stdio_environment(), cwd=endpoint.working_directory(base_dir),
    )
    return params if max_message_bytes is None else bounded_stdio_client(params, max_message_bytes)


def message_limit(server: Server) -> int:
    """Largest MCP message read from ``server``: room for a result at its size limit twice over (text
    and structured content), JSON escaping and the envelope; the result itself is checked exactly
    by the classifier (``worker/results.py``)."""
    from proofline.settings import get_settings

    limit = min(v for v in (get_settings().max_result_bytes, server.max_result_bytes) if v is not None)
    return 4 * limit + 64 * 1024


class _Session:
    """One open MCP client, owned by one task on the portal's event loop."""

    def __init__(self, endpoint: Endpoint, base_dir: Path, max_message_bytes: int | None = None) -> None:
        self.endpoint = endpoint
        self.base_dir = base_dir
        self.max_message_bytes = max_message_bytes
        self.client: Client | None = None
        self.error: BaseException | None = None
        self.dead = False
        self._ready: anyio.Event | None = None
        self._stop: anyio.Event | None = None

    async def run(self) -> None:
        self._ready, self._stop = anyio.Event(), anyio.Event()
        try:
            target = endpoint_target(self.endpoint, self.base_dir, self.max_message_bytes)
            async with Client(target, mode=self.endpoint.protocol) as client:
                self.client = client
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - a dead session is recorded, never raised here
            self.error = exc
        finally:
            self.client = None
            self.dead = True
            self._ready.set()

    async def wait_ready(self) -> None:
        while self._ready is None:
            await anyio.sleep(0.001)
        with anyio.fail_after(CONNECT_TIMEOUT_SECONDS):
            await self._ready.wait()

    async def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()


class CallCancelled(Exception):
    """The call was cancelled on purpose (an operator's cancellation), after it may have been sent."""


class CancelHandle:
    """Lets one thread cancel a call that another thread is waiting on."""

    def __init__(self) -> None:
        self.portal: BlockingPortal | None = None
        self.scope: anyio.CancelScope | None = None
        self.requested = False

    def cancel(self) -> None:
        self.requested = True
        if self.portal is not None and self.scope is not None:
            self.portal.call(self.scope.cancel)


async def _cancellable(fn: Callable[[Client], Awaitable[T]], client: Client, handle: CancelHandle) -> T:
    with anyio.CancelScope() as scope:
        handle.scope = scope
        if handle.requested:
            scope.cancel()
        return await fn(client)
    raise CallCancelled("call cancelled at the operator's request")


class McpSessions:
    """The per-process registry of open MCP sessions."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.pid = os.getpid()
        self._stack = ExitStack()
        self._portal: BlockingPortal = self._stack.enter_context(start_blocking_portal())
        self._sessions: dict[tuple[str, Role], _Session] = {}
        self._lock = threading.Lock()

    def _session(self, server: Server, role: Role) -> _Session:
        key = (server.name, role)
        with self._lock:
            session = self._sessions.get(key)
            if session is not None and not session.dead:
                return session
            endpoint = server.write if role == "write" else server.read
            session = _Session(endpoint, self.base_dir, message_limit(server))
            self._portal.start_task_soon(session.run)
            try:
                self._portal.call(session.wait_ready)
            except TimeoutError as exc:
                raise McpUnavailable(f"{server.name}/{role}: no session within {CONNECT_TIMEOUT_SECONDS}s") from exc
            if session.client is None:
                raise McpUnavailable(f"{server.name}/{role}: cannot open a session: {session.error!r}")
            self._sessions[key] = session
            return session

    def run(self, server: Server, role: Role, fn: Callable[[Client], Awaitable[T]],
            cancel_handle: CancelHandle | None = None) -> T:
        """Run ``fn(client)`` on the session's event loop and return its result.

        Raises :class:`McpUnavailable` when no session can be opened: nothing was sent then. With a
        ``cancel_handle``, another thread may cancel the call; the SDK then sends the server
        ``notifications/cancelled`` and this raises :class:`CallCancelled`.
        """
        session = self._session(server, role)
        client = session.client
        if client is None:  # died between lookup and use; nothing was sent
            raise McpUnavailable(f"{server.name}/{role}: session closed before the request")
        if cancel_handle is None:
            return self._portal.call(fn, client)
        cancel_handle.portal = self._portal
        return self._portal.call(_cancellable, fn, client, cancel_handle)

    def server_version(self, server: Server, role: Role = "write") -> str | None:
        session = self._session(server, role)
        info = session.client.server_info if session.client else None
        return info.version if info else None

    def discard(self, server: Server, role: Role) -> None:
        """Drop a session after a transport failure so the next call reconnects."""
        with self._lock:
            session = self._sessions.pop((server.name, role), None)
        if session is not None:
            self._portal.call(session.stop)

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            try:
                self._portal.call(session.stop)
            except Exception:  # noqa: BLE001 - closing at exit must not raise
                pass
        self._stack.close()


_current: McpSessions | None = None
_current_lock = threading.Lock()


def sessions(base_dir: Path) -> McpSessions:
    """This process's sessions; a forked child never reuses its parent's event loop."""
    global _current
    with _current_lock:
        if _current is None or _current.pid != os.getpid():
            _current = McpSessions(base_dir)
            atexit.register(_current.close)
        return _current


def close_sessions() -> None:
    global _current
    with _current_lock:
        if _current is not None and _current.pid == os.getpid():
            _current.close()
        _current = None
