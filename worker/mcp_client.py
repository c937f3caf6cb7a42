"""MCP sessions kept per worker process and reused across tasks.

Spawning a stdio server costs ~700 ms and a new HTTP client ~30 ms, so each pool child keeps one
session per (server, identity) open. anyio requires a client context to be entered and exited
by the same task, so each session lives in its own task on a blocking portal (an event-loop
thread created lazily *after* fork, in the process that uses it); tasks hand it coroutines to run.
A session that dies (server killed, connection lost) is replaced on the next call.

stdio servers run sandboxed (worker/sandbox.py). bwrap writes the sandboxed process's exit status
to a per-session status file, so a server killed by a limit is told apart from one that merely
closed: such a death is a sandbox violation, counted here and recorded on the call it broke. An
audited sandbox (worker/sandbox_audit.py) also reports the paths, addresses and syscalls it denied;
each is a violation too, counted when found and kept for the ledger with the action whose call was
in flight (:meth:`McpSessions.take_audit`).
"""

from __future__ import annotations

import atexit
import logging
import os
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal
from mcp import Client

from proofline.envelope import reported_version
from proofline.errors import McpUnavailable, SandboxAuditOverflow
from proofline.pins import Negotiated
from proofline.server_requests import ServerRequestPolicy
from worker import calls, host_client, request_ids, sandbox, token_exchange
from worker.connect import WatchedTransport, connectable, endpoint_target
from worker.oauth import Identity
from worker.sandbox_egress import Forwarder
from worker.sandbox_reader import OVERFLOW_EVENT, Auditor, alive, owned_prefix
from worker.server_requests import SUPPRESSED_EVENT, RequestGate, declared_roots, limit_capabilities
from worker.servers import Endpoint, Server
from worker.tool_list import ToolListCache

T = TypeVar("T")
Role = Literal["write", "read"]
#: How long a new session may take to open, unless the process's settings say otherwise
#: (``Settings.mcp_connect_timeout_seconds``).
CONNECT_TIMEOUT_SECONDS = 15.0
#: Rounds of a 2026-07-28 ``InputRequiredResult`` the client answers before the call fails.
INPUT_ROUNDS = 3
#: How long to wait for bwrap's exit status after a sandboxed session's pipe closed.
STATUS_WAIT_SECONDS = 1.0

log = logging.getLogger(__name__)
_violations = 0
_violations_lock = threading.Lock()


def sandbox_violations() -> int:
    """Sandbox violations (servers killed by a limit, denied paths, addresses and syscalls) seen by
    this process, for metrics."""
    return _violations


def _count_violation(n: int = 1) -> None:
    global _violations
    with _violations_lock:
        _violations += n


def _audited(found: dict[str, Any]) -> None:
    # Counted by the auditor (all of them); logged here for the ones it keeps, not once per line of a flood.
    log.warning("sandbox denied a server", extra={"event": "sandbox_violation", **found})


def negotiated(client: Client) -> Negotiated:
    """The protocol version ``client``'s session speaks and the capabilities its server declared."""
    session = client.session
    caps = session.server_capabilities
    return Negotiated(session.protocol_version,
                      caps.model_dump(mode="json", by_alias=True, exclude_none=True) if caps is not None else {})


def message_limit(server: Server) -> int:
    """Largest MCP message read from ``server``: room for a result at its size limit twice over (text
    and structured content), JSON escaping and the envelope; the result itself is checked exactly
    by the classifier (``worker/results.py``)."""
    from proofline.settings import get_settings

    limit = min(v for v in (get_settings().max_result_bytes, server.max_result_bytes) if v is not None)
    return 4 * limit + 64 * 1024


class _GovernedClient(Client):
    """``mcp.Client`` whose capability announcement names only what the runtime's policy answers
    (worker/server_requests.py): it holds a callback for every server request so that each one is
    recorded, and the SDK would otherwise announce all three."""

    advertised: frozenset[str] = frozenset()
    #: Request ids start past this one: a lent server's earlier borrowers minted the ids below it.
    id_base: int = 0

    async def _build_session(self, exit_stack: Any) -> Any:
        session = await super()._build_session(exit_stack)
        limit_capabilities(session, self.advertised)
        dispatcher = getattr(session, "_dispatcher", None)
        if self.id_base and isinstance(getattr(dispatcher, "_next_id", None), int):
            dispatcher._next_id = self.id_base  # type: ignore[union-attr]  # noqa: SLF001
        return session


class _Session:
    """One open MCP client, owned by one task on the portal's event loop."""

    def __init__(self, endpoint: Endpoint, base_dir: Path, name: str = "?", role: str = "write",
                 environment: str = "development", max_message_bytes: int | None = None,
                 gate: RequestGate | None = None, action_id: Callable[[], str | None] = lambda: None,
                 auth: Any = None, loan: host_client.Loan | None = None) -> None:
        self.endpoint = endpoint
        #: The node's session host lent this session its server (worker/session_host.py), or None.
        self.loan = loan
        self.auth = auth
        self.gate = gate
        self._action_id = action_id
        self.base_dir = base_dir
        self.name, self.role, self.environment = name, role, environment
        #: This session's own id, recorded with every request id minted on it (worker/request_ids.py).
        self.session_id = request_ids.new_session_id()
        self.max_message_bytes = max_message_bytes
        self.client: Client | None = None
        self.error: BaseException | None = None
        self.dead = False
        self.stopping = False
        self._ready: anyio.Event | None = None
        self._stop: anyio.Event | None = None
        self._starting: anyio.CancelScope | None = None
        self.status_path: str | None = None
        self.checked: dict[str, Any] | None = None
        self.auditor: Auditor | None = None
        self.egress: Forwarder | None = None
        #: This session's tool list (a new session starts empty: a reconnection always lists again).
        self.tools = ToolListCache()
        self.transport: WatchedTransport | None = None
        self._child_pid: int | None = None
        if endpoint.transport == "stdio":
            # Refused here (production, no reason) as a configuration error, before anything is spawned.
            sandbox.require_policy(name, role, endpoint.sandbox, environment)
            if loan is not None:
                self.status_path = loan.status_path
                if loan.audited:
                    self.auditor = host_client.RemoteAudit(loan, _count_violation)  # type: ignore[assignment]
            elif endpoint.sandbox.enabled:
                unaudited = sandbox.require_audit(name, role, endpoint.sandbox, environment)
                fd, self.status_path = tempfile.mkstemp(prefix=owned_prefix("sandbox"), suffix=".json")
                os.close(fd)
                if endpoint.sandbox.egress is not None:
                    self.egress = Forwarder(name, role, endpoint.sandbox.egress)
                if unaudited is None:
                    self.auditor = Auditor(name, role, on_violation=_audited, counted=_count_violation)
                else:
                    log.warning("sandboxed server runs without auditing", extra={
                        "event": "sandbox_audit_disabled", "server": name, "role": role, "reason": unaudited})

    async def run(self) -> None:
        self._ready, self._stop = anyio.Event(), anyio.Event()
        try:
            if self.loan is not None:
                target = host_client.host_stdio_client(self.loan, self.max_message_bytes or 1 << 24)
            else:
                target = endpoint_target(self.endpoint, self.base_dir, name=self.name, role=self.role,
                                         environment=self.environment, status_path=self.status_path,
                                         max_message_bytes=self.max_message_bytes, audit=self.auditor,
                                         watch=self._watch, egress=self.egress, auth=self.auth)
            governed = self.gate.callbacks(self._action_id) if self.gate is not None else {}
            client = _GovernedClient(connectable(target, self.name, self.role), mode=self.endpoint.protocol,
                                     message_handler=self.tools.notify,
                                     # A write is re-sent once per answered round of an InputRequiredResult:
                                     # never more than a few times.
                                     input_required_max_rounds=INPUT_ROUNDS, **governed)
            client.advertised = self.gate.advertised if self.gate is not None else frozenset()
            client.id_base = self.loan.id_base if self.loan is not None else 0
            with anyio.CancelScope() as self._starting:  # stop() before ready: the start is abandoned
                async with client:
                    self.client = client
                    self._ready.set()
                    await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - a dead session is recorded, never raised here
            self.error = exc
        finally:
            self.client = None
            self.dead = True
            self._ready.set()

    def _watch(self, transport: WatchedTransport) -> None:
        self.transport = transport

    def connections(self) -> frozenset[Any] | None:
        """What this session talks over now: the HTTP connections it holds open, or the sandboxed
        stdio server's process while it lives (empty once it is gone, even before the session has
        read the end of its output); None for an unsandboxed stdio server (its session ends with it)."""
        if self.transport is not None:
            return self.transport.open_connections()
        if self.status_path is None:
            return None
        if self._child_pid is None:
            self._child_pid = sandbox.read_status(self.status_path).get("child-pid")
        return frozenset({self._child_pid}) if self._child_pid and alive(self._child_pid) else frozenset()

    async def tool_hashes(self, max_age: float) -> dict[str, str]:
        """The server's tool contract hashes, from this session's cache while it is valid."""
        client = self.client
        if client is None:
            raise McpUnavailable(f"{self.name}/{self.role}: session closed before the request")
        return await self.tools.get(lambda: calls.live_tool_hashes(client), max_age, self.connections)

    def violation(self) -> dict[str, Any] | None:
        """If this session's sandboxed process was killed by a limit: the evidence (counted once)."""
        if self.checked is not None or self.status_path is None:
            return self.checked or None
        status = sandbox.read_status(self.status_path)
        if "exit-code" not in status:
            if "child-pid" not in status or alive(status["child-pid"]):
                return None  # never started, or still running: nothing to say yet
            deadline = time.monotonic() + STATUS_WAIT_SECONDS
            while "exit-code" not in status and time.monotonic() < deadline:
                time.sleep(0.02)  # the child is gone; bwrap writes its exit code just before exiting
                status = sandbox.read_status(self.status_path)
        found = None if self.stopping else sandbox.violation(status.get("exit-code"))
        self.checked = {}
        if found is not None:
            self.checked = {"server": self.name, "role": self.role, **found}
            _count_violation()
            log.warning("sandboxed server killed", extra={"event": "sandbox_violation", **self.checked})
        return self.checked or None

    def give_back(self) -> None:
        """A lent server goes back to the host for the next borrower (this process is closing)."""
        if self.loan is not None:
            if isinstance(self.auditor, host_client.RemoteAudit):
                self.auditor.end(False, 0.0)
            else:
                self.loan.end(False)

    def cleanup(self) -> None:
        if self.loan is not None:
            if isinstance(self.auditor, host_client.RemoteAudit):
                self.auditor.close()
            else:
                self.loan.end(True)  # a failed or replaced session: the host stops its server
            return  # the host owns the server's files
        if self.auditor is not None:
            self.auditor.close()
        if self.egress is not None:
            self.egress.close()
        if self.status_path is not None:
            try:
                os.unlink(self.status_path)
            except OSError:
                pass

    @property
    def fails_closed(self) -> bool:
        """Whether a call whose audit lost lines fails (``sandbox.audit.on_overflow``)."""
        return self.auditor is not None and self.endpoint.sandbox.audit_policy.fails_closed(self.environment)

    def drain(self) -> None:
        """Read the audit to its end (the server is gone or going), so nothing it wrote is lost."""
        if self.auditor is not None:
            self.auditor.finish(self.endpoint.sandbox.audit_policy.drain_seconds)

    async def wait_ready(self, timeout: float) -> None:
        while self._ready is None:
            await anyio.sleep(0.001)
        with anyio.fail_after(timeout):
            await self._ready.wait()

    async def stop(self) -> None:
        self.stopping = True
        if self._stop is not None:
            self._stop.set()
        if self.client is None and self._starting is not None:
            # Still connecting (a server slow to start): cancel it, which ends the server's process.
            self._starting.cancel()


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

    def __init__(self, base_dir: Path, environment: str = "development", connect_timeout: float | None = None) -> None:
        self.base_dir = base_dir
        self.environment = environment
        #: Seconds a new session may take to open (server started, initialization answered).
        self.connect_timeout = CONNECT_TIMEOUT_SECONDS if connect_timeout is None else connect_timeout
        self.pid = os.getpid()
        self._stack = ExitStack()
        self._portal: BlockingPortal = self._stack.enter_context(start_blocking_portal())
        self._sessions: dict[tuple[str, Role], _Session] = {}
        self._lock = threading.RLock()
        self._audit_lock = threading.Lock()
        #: Audit findings not yet written to the ledger, and the action the calls are made for.
        self._audit: list[dict[str, Any]] = []
        self.action_id: str | None = None
        #: The in-flight action's contract narrowing of its servers' request policies (or None).
        self.request_policy: ServerRequestPolicy | None = None
        #: The session and JSON-RPC request id(s) of the last :meth:`run` (worker/request_ids.py).
        self.last_request: dict[str, Any] = {}
        #: Who answers a server's elicitation when its policy routes it to approvers (None: the
        #: process settings' ledger, worker/elicitation_route.py).
        self.approver_route: Any = None
        #: OAuth state per (server, identity), kept across reconnections (worker/oauth.py).
        self._identities: dict[tuple[str, Role], Identity] = {}

    def _identity(self, server: Server, role: Role) -> Identity | None:
        endpoint = server.write if role == "write" else server.read
        if endpoint.auth is None:
            return None
        with self._lock:
            held = self._identities.get((server.name, role))
            if held is None or held.endpoint != endpoint:  # a changed servers file starts afresh
                from proofline.settings import get_settings

                held = Identity(server.name, role, endpoint, Path(get_settings().state_dir),
                                lambda event, body: self._note_request(event, body, self.action_id))
                self._identities[(server.name, role)] = held
            return held

    def _authorize(self, server: Server, role: Role) -> Identity | None:
        """Hold a token for the identity that outlives its margin (ServerAuthFailed: nothing was sent)."""
        identity = self._identity(server, role)
        if identity is not None:
            self._portal.call(identity.ensure)
        return identity

    @contextmanager
    def exchanged_token(self, server: Server, role: Role, tool: str, remaining_seconds: float) -> Iterator[Any]:
        """Inside, the identity's requests carry a token exchanged for this call (RFC 8693,
        worker/token_exchange.py) when its ``auth:`` block asks for one; yields it (or None). Raises
        a TokenExchangeRefused (or ServerAuthFailed) before anything is sent."""
        identity = self._identity(server, role)
        if identity is None or identity.spec.token_exchange is None:
            yield None
            return
        got = self._portal.call(token_exchange.exchange, identity, tool, remaining_seconds)
        identity.carrying = got
        try:
            yield got
        finally:
            identity.carrying = None

    @contextmanager
    def acting_for(self, action_id: str) -> Iterator[None]:
        """Calls made inside are this action's: what their audits find is recorded on it."""
        previous, self.action_id = self.action_id, action_id
        try:
            yield
        finally:
            self.action_id = previous

    def _note_request(self, event: str, body: dict[str, Any], action_id: str | None) -> None:
        # Its own lock: the portal's thread reports here while the caller's holds ``_lock``.
        with self._audit_lock:
            self._audit.append({"_event": event, **body, "in_flight": True, "action_id": action_id})

    def _collect(self, session: _Session, in_flight: bool) -> list[dict[str, Any]]:
        """Keep what the session's audit and request gate found; returns the audit's overflow records."""
        if session.gate is not None:
            limit = session.gate.policy().max_per_call
            for action_id, count in session.gate.take_suppressed(limit).items():
                self._note_request(SUPPRESSED_EVENT, {"server": session.name, "role": session.role,
                                                      "suppressed": count, "recorded": limit}, action_id)
        if session.auditor is None:
            return []
        taken = session.auditor.take()
        with self._audit_lock:
            self._audit.extend({**found, "in_flight": in_flight, "action_id": self.action_id} for found in taken)
        return [f for f in taken if f.get("_event") == OVERFLOW_EVENT]

    def _retire(self, session: _Session) -> dict[str, Any] | None:
        """End a session for good: its violation (before stopping it, which is no violation), then
        its audit read to the end and kept, then its files. Returns the violation, if any."""
        found = session.violation()
        self._portal.call(session.stop)
        session.drain()
        self._collect(session, in_flight=True)
        session.cleanup()
        return found

    def take_audit(self) -> list[dict[str, Any]]:
        """Every audit finding not yet taken, each with the ``action_id`` whose call was in flight
        (None, or ``in_flight`` false, when it happened between calls)."""
        with self._audit_lock:
            out, self._audit = self._audit, []
        return out

    def _session(self, server: Server, role: Role) -> _Session:
        key = (server.name, role)
        with self._lock:
            session = self._sessions.get(key)
            if session is not None and not session.dead:
                return session
            if session is not None:
                self._retire(session)
            endpoint = server.write if role == "write" else server.read
            identity = self._authorize(server, role)
            limit = message_limit(server)
            if endpoint.transport == "stdio":
                # Refused first (production, no reason) as a configuration error, before anything is borrowed.
                sandbox.require_policy(server.name, role, endpoint.sandbox, self.environment)
            loan = host_client.borrow(endpoint, server.name, role, self.base_dir, self.environment, limit) \
                if endpoint.transport == "stdio" else None
            session = _Session(endpoint, self.base_dir, server.name, role, self.environment, limit,
                               self._gate(server, role, endpoint), lambda: self.action_id,
                               identity.provider if identity is not None else None, loan)
            self._portal.start_task_soon(session.run)
            try:
                self._portal.call(session.wait_ready, self.connect_timeout)
            except TimeoutError as exc:
                self._retire(session)  # the server, its tracer and its files go too
                raise McpUnavailable(f"{server.name}/{role}: no session within {self.connect_timeout:g}s "
                                     "(PROOFLINE_MCP_CONNECT_TIMEOUT_SECONDS)") from exc
            if session.client is None:
                found = session.violation()
                status = sandbox.read_status(session.status_path) if session.status_path else {}
                session.cleanup()
                detail = f"; sandbox exit {status['exit-code']}" if "exit-code" in status else ""
                raise McpUnavailable(f"{server.name}/{role}: cannot open a session: {session.error!r}{detail}",
                                     **({"sandbox_violation": found} if found else {}))
            if session.auditor is not None:
                session.auditor.settle()
                if not session.auditor.armed:
                    # strace writes the marker before the server starts: without it nothing is audited.
                    self._retire(session)
                    raise McpUnavailable(f"{server.name}/{role}: the sandbox audit did not start")
            self._sessions[key] = session
            return session

    def _gate(self, server: Server, role: Role, endpoint: Endpoint) -> RequestGate:
        configured = server.server_requests
        spec = endpoint.sandbox
        roots = declared_roots(spec.ro_paths + spec.read_only_data, spec.rw_paths, self.base_dir) \
            if endpoint.transport == "stdio" and spec.enabled else []
        route = None
        if configured.elicitation == "approver":
            from proofline.settings import get_settings
            from worker.elicitation_route import ApproverRoute

            route = self.approver_route or ApproverRoute(get_settings)
        return RequestGate(server.name, role, configured, lambda: configured.narrowed(self.request_policy),
                           self._note_request, roots, route)

    def run(self, server: Server, role: Role, fn: Callable[[Client], Awaitable[T]],
            cancel_handle: CancelHandle | None = None) -> T:
        """Run ``fn(client)`` on the session's event loop and return its result.

        Raises :class:`McpUnavailable` when no session can be opened: nothing was sent then. With a
        ``cancel_handle``, another thread may cancel the call; the SDK then sends the server
        ``notifications/cancelled`` and this raises :class:`CallCancelled`.
        """
        self.last_request = {}  # nothing sent yet: a refused session leaves no stale ids behind
        session = self._session(server, role)
        self._authorize(server, role)  # a token that expires mid-run is replaced before the request
        client = session.client
        if client is None:  # died between lookup and use; nothing was sent
            raise McpUnavailable(f"{server.name}/{role}: session closed before the request")
        if self._collect(session, in_flight=False) and session.fails_closed:
            self.discard(server, role)
            raise SandboxAuditOverflow(f"{server.name}/{role}: the sandbox audit lost lines before the call; "
                                       "nothing was sent", sent=False, server=server.name, role=role)
        before = request_ids.counter(client)
        try:
            if cancel_handle is None:
                return self._portal.call(fn, client)
            cancel_handle.portal = self._portal
            return self._portal.call(_cancellable, fn, client, cancel_handle)
        finally:
            self.last_request = request_ids.minted(session.session_id, before, request_ids.counter(client))
            lost = self._collect(session, in_flight=True)
            if lost and session.fails_closed:  # recorded either way; fail_closed refuses the call's result too
                raise SandboxAuditOverflow(f"{server.name}/{role}: the sandbox audit lost lines during the call "
                                           f"({lost[-1]['reason']})", sent=True, server=server.name, role=role)

    def tool_hashes(self, server: Server, max_age: float, role: Role = "write") -> tuple[dict[str, str], str | None]:
        """The contract hashes of the tools ``server`` lists, and why they were listed now (None when
        they came from the session's cache; see worker/tool_list.py)."""
        session = self._session(server, role)
        self._authorize(server, role)
        hashes = self._portal.call(session.tool_hashes, max_age)
        return hashes, session.tools.last_miss

    def server_version(self, server: Server, role: Role = "write") -> str:
        """The version the server reported at initialization, as recorded (``NO_VERSION`` for none)."""
        session = self._session(server, role)
        info = session.client.server_info if session.client else None
        return reported_version(info.version if info else None)

    def negotiated(self, server: Server, role: Role = "write") -> Negotiated:
        """What this process's session with ``server`` negotiated (opening one if needed)."""
        session = self._session(server, role)
        if session.client is None:
            raise McpUnavailable(f"{server.name}/{role}: session closed before the request")
        return negotiated(session.client)

    def unsandboxed_reason(self, server: Server, role: Role) -> str | None:
        """Why the server behind this identity runs unsandboxed (recorded on calls), or None."""
        endpoint = server.write if role == "write" else server.read
        if endpoint.transport != "stdio":
            return None
        return sandbox.require_policy(server.name, role, endpoint.sandbox, self.environment)

    def discard(self, server: Server, role: Role) -> dict[str, Any] | None:
        """Drop a session after a transport failure so the next call reconnects.

        Returns the sandbox violation that killed it, if its sandboxed process was killed by a limit."""
        with self._lock:
            session = self._sessions.pop((server.name, role), None)
        if session is None:
            return None
        return self._retire(session)

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            try:
                self._portal.call(session.stop)
            except Exception:  # noqa: BLE001 - closing at exit must not raise
                pass
        for session in sessions:
            session.give_back()  # a lent server stays with the host for this node's next process
            session.drain()  # strace's output to its end: no write into a closed pipe
            session.cleanup()
        for identity in list(self._identities.values()):
            try:
                self._portal.call(identity.close)
            except Exception:  # noqa: BLE001 - closing at exit must not raise
                pass
        self._stack.close()


_current: McpSessions | None = None
_current_lock = threading.Lock()


def sessions(base_dir: Path, environment: str = "development", connect_timeout: float | None = None) -> McpSessions:
    """This process's sessions; a forked child never reuses its parent's event loop."""
    global _current
    with _current_lock:
        if _current is None or _current.pid != os.getpid():
            _current = McpSessions(base_dir, environment, connect_timeout)
            atexit.register(_current.close)
        return _current


def close_sessions() -> None:
    global _current
    with _current_lock:
        if _current is not None and _current.pid == os.getpid():
            _current.close()
        _current = None
