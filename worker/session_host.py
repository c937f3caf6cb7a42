"""The node's stdio session host: MCP server processes that outlive the pool processes using them.

A pool process that opens its own stdio sessions pays for each server's start (bubblewrap, strace,
the server's interpreter) before its first action, and a pool process killed or recycled takes its
servers with it. Under a fleet that loses pool processes often, that start costs more than the
processes live. The worker's main process therefore starts this host (``worker/host_process.py``):
one process per node that launches the sandboxed, audited stdio servers exactly as a pool process
would (``worker/connect.py``) and lends each to one pool process at a time.

A pool process *checks out* a server for an identity on a control connection (a Unix socket in a
folder only the worker's user can open) and then talks MCP to it over a data connection; the host
relays the bytes, reads the audit, and keeps the server when the pool process goes:

- **One borrower at a time.** Every server process is lent to one pool process; a pool process that
  needs an identity no idle server serves gets a new one (and the host starts a spare behind it).
- **A new borrower is a new client.** Its ``initialize`` is answered from the answer the server gave
  the first one (the protocol's state is the server's, negotiated once); its request ids start past
  every id an earlier borrower could have minted (``id_base``), so an answer, progress notification
  or cancel of an earlier borrower can never be taken for one of its own. What the host forwards to
  a borrower is an answer to a request it sent, a request or notification of the server's while it
  is the borrower, nothing else.
- **A borrower that goes mid-call** (killed: its sockets close) has its unanswered requests
  cancelled (``notifications/cancelled``, as the SDK's own session does when its transport ends) and
  the server's requests to it answered with an error; the server then waits for the next borrower.
  The runtime reconciles the interrupted action like any other unknown outcome.
- **A borrower that retires its session** (a transport failure, a violation, a changed servers
  file) has the server stopped and its audit read to the end; the findings go back in the answer.
- **The audit stays with the server.** The host reads strace's FIFO; a borrower takes what was found
  since its last take on the control connection, after each call, as an in-process session does.
  strace writes a line before the traced process goes on, so when a call's answer has reached the
  borrower, its findings are in the FIFO.

Nothing a server sends is trusted more than it would be in a pool process: lines are bounded to the
borrower's message limit (``worker/bounded_stdio.py``) before they are parsed, and a line that is not
JSON-RPC goes through to the borrower as it came, to fail there as it would have.

Run as ``python -m worker.session_host --socket PATH``; it exits when its parent does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker import sandbox
from worker.sandbox_egress import Forwarder
from worker.sandbox_reader import Auditor, owned_prefix
from worker.server_stderr import errlog_for
from worker.servers import Endpoint
from worker.stdio_launch import inherited_environment, stdio_launch
from worker.stdio_lines import Line, split_lines

log = logging.getLogger("worker.session_host")

#: Request ids one borrower may mint; the next borrower of the same server starts past them.
ID_SPAN = 1 << 40
#: Longest control request a borrower may send (they carry one endpoint's settings).
MAX_CONTROL_BYTES = 1 << 20
#: How long a retired server is given to exit after its input closed, before it is killed.
STOP_SECONDS = 2.0
#: JSON-RPC error the host answers a server's request with when no borrower can answer it.
NO_BORROWER = -32001
#: Idle servers of an identity nobody has asked for in this long are stopped (a changed servers
#: file makes a new identity; the old one's servers would otherwise idle for the worker's life).
UNWANTED_SECONDS = 600.0


@dataclass(frozen=True)
class Spec:
    """What a borrower asks for: one identity of one server, launched as the borrower would."""

    server: str
    role: str
    endpoint: dict[str, Any]
    base_dir: str
    environment: str
    max_message_bytes: int

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.__dict__, sort_keys=True, default=str).encode()).hexdigest()


def _jsonrpc(message: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(message)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _in_range(ident: Any, base: int) -> bool:
    return isinstance(ident, int) and not isinstance(ident, bool) and base <= ident < base + ID_SPAN


def _line(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


@dataclass(eq=False)
class Served:
    """One server process and what the host knows of its protocol state."""

    spec: Spec
    process: asyncio.subprocess.Process
    auditor: Auditor | None
    egress: Forwarder | None
    status_path: str | None
    #: Checkouts so far: the n-th borrower mints ids from n * ID_SPAN.
    loans: int = 0
    borrower: Borrower | None = None
    initialize: dict[str, Any] | None = None  # the server's answer to the first initialize
    initialize_params: dict[str, Any] | None = None
    initialize_pending: Any = None
    initialized_sent: bool = False
    #: Its first borrower's initialize was refused: not a session to lend again.
    broken: bool = False
    dead: bool = False
    counted: int = 0  # violations the audit counted since the last take
    writer_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def send(self, data: bytes) -> None:
        stdin = self.process.stdin
        if stdin is None or self.dead:
            return
        async with self.writer_lock:
            try:
                stdin.write(data)
                await stdin.drain()
            except (ConnectionError, RuntimeError):
                self.dead = True


@dataclass(eq=False)
class Borrower:
    """One pool process's loan of a server: its data stream and what it has outstanding."""

    served: Served
    lease: str
    #: Its requests' ids lie in [id_base, id_base + ID_SPAN): past every earlier borrower's.
    id_base: int = 0
    writer: asyncio.StreamWriter | None = None
    attached: asyncio.Event = field(default_factory=asyncio.Event)
    outstanding: set[Any] = field(default_factory=set)  # its requests the server has not answered
    asked: set[Any] = field(default_factory=set)  # the server's requests it has not answered

    async def deliver(self, data: bytes) -> None:
        writer = self.writer
        if writer is None:
            return
        try:
            writer.write(data)
            await writer.drain()
        except (ConnectionError, RuntimeError):
            pass  # gone: its control connection's end settles the loan


class Host:
    def __init__(self, socket_path: str, spares: int = 1) -> None:
        self.socket_path = socket_path
        self.spares = spares
        self.idle: dict[str, list[Served]] = {}
        self.leases: dict[str, Borrower] = {}
        self.all: set[Served] = set()
        self._starting: dict[str, int] = {}
        self._wanted: dict[str, float] = {}  # identity -> when it was last checked out (monotonic)
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- server processes -------------------------------------------------------------------------------

    async def launch(self, spec: Spec) -> Served:
        endpoint = Endpoint.model_validate(spec.endpoint)
        base_dir = Path(spec.base_dir)
        auditor = egress = status_path = None
        if endpoint.sandbox.enabled and sandbox.require_policy(spec.server, spec.role, endpoint.sandbox,
                                                               spec.environment) is None:
            fd, status_path = tempfile.mkstemp(prefix=owned_prefix("sandbox"), suffix=".json")
            os.close(fd)
            if endpoint.sandbox.egress is not None:
                egress = Forwarder(spec.server, spec.role, endpoint.sandbox.egress)
            if sandbox.require_audit(spec.server, spec.role, endpoint.sandbox, spec.environment) is None:
                auditor = Auditor(spec.server, spec.role)
        params = stdio_launch(endpoint, base_dir, name=spec.server, role=spec.role, environment=spec.environment,
                              status_path=status_path, audit=auditor, egress=egress)
        process = await asyncio.create_subprocess_exec(
            params.command, *params.args, env=inherited_environment() | params.env, cwd=params.cwd,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=errlog_for(spec.server, spec.role),
            limit=1 << 16)
        served = Served(spec, process, auditor, egress, status_path)
        if auditor is not None:
            auditor.counted = lambda n, s=served: setattr(s, "counted", s.counted + n)
        self.all.add(served)
        self._spawn(self._pump(served))
        log.info("server started", extra={"event": "session_host_server_started", "server": spec.server,
                                          "role": spec.role, "pid": process.pid})
        return served

    async def _pump(self, served: Served) -> None:
        """The server's output, line by line, to its borrower (or answered here when it has none)."""
        limit = served.spec.max_message_bytes
        line = Line(limit)
        stdout = served.process.stdout
        assert stdout is not None
        try:
            while chunk := await stdout.read(65536):
                done, line = split_lines(chunk, line)
                for complete in done:
                    raw = complete.raw()
                    if raw is not None:
                        await self._from_server(served, raw)
        finally:
            served.dead = True
            borrower = served.borrower
            if borrower is not None and borrower.writer is not None:
                borrower.writer.close()  # the borrower's session sees its server end
            elif borrower is None:
                await self.stop(served)

    async def _from_server(self, served: Served, raw: bytes) -> None:
        borrower = served.borrower
        message = _jsonrpc(raw)
        if message is None:
            if borrower is not None:
                await borrower.deliver(raw + b"\n")
            return
        method, has_id = message.get("method"), "id" in message
        if method is None and has_id:  # an answer
            ident = message["id"]
            if served.initialize_pending is not None and ident == served.initialize_pending:
                served.initialize_pending = None
                if "result" in message:
                    served.initialize = message
                else:
                    served.broken = True
            if borrower is not None and ident in borrower.outstanding:
                borrower.outstanding.discard(ident)
                await borrower.deliver(raw + b"\n")
            return
        if method is not None and has_id:  # a request of the server's
            if borrower is not None and borrower.writer is not None:
                borrower.asked.add(message["id"])
                await borrower.deliver(raw + b"\n")
            elif method == "ping":
                await served.send(_line({"jsonrpc": "2.0", "id": message["id"], "result": {}}))
            else:
                await served.send(_line({"jsonrpc": "2.0", "id": message["id"], "error": {
                    "code": NO_BORROWER, "message": "no client is attached to this session now"}}))
            return
        if borrower is None:
            return  # a notification nobody is there to read (a new borrower lists tools afresh)
        if method == "notifications/progress":
            params = message.get("params")
            token = params.get("progressToken") if isinstance(params, dict) else None
            if token not in borrower.outstanding:
                return  # progress of an earlier borrower's request
        await borrower.deliver(raw + b"\n")

    async def _from_borrower(self, borrower: Borrower, raw: bytes) -> None:
        served = borrower.served
        message = _jsonrpc(raw)
        if message is None:
            await served.send(raw + b"\n")
            return
        method, has_id = message.get("method"), "id" in message
        if method == "initialize" and has_id:
            params = message.get("params") if isinstance(message.get("params"), dict) else {}
            if served.initialize is not None:
                if (served.initialize_params or {}).get("protocolVersion") != params.get("protocolVersion"):
                    await borrower.deliver(_line({"jsonrpc": "2.0", "id": message["id"], "error": {
                        "code": -32602, "message": "this server's session was negotiated for another protocol version"}}))
                    return
                await borrower.deliver(_line({**served.initialize, "id": message["id"]}))
                return
            served.initialize_pending, served.initialize_params = message["id"], params
        if method is not None and has_id and not _in_range(message["id"], borrower.id_base):
            # An id an earlier borrower may have used: its late answer could be taken for this one's.
            await borrower.deliver(_line({"jsonrpc": "2.0", "id": message["id"], "error": {
                "code": -32600, "message": f"request id outside this loan's range, which starts at {borrower.id_base}"}}))
            return
        if method == "notifications/initialized":
            if served.initialized_sent:
                return
            served.initialized_sent = True
        if method == "notifications/cancelled":
            params = message.get("params")
            if isinstance(params, dict):
                # The borrower cancelled it itself: not one to cancel again on its behalf, and a
                # late answer is no longer its to read.
                borrower.outstanding.discard(params.get("requestId"))
        if method is not None and has_id:
            borrower.outstanding.add(message["id"])
        elif method is None and has_id:
            borrower.asked.discard(message["id"])
        await served.send(raw + b"\n")

    async def _cancel_outstanding(self, borrower: Borrower) -> None:
        """Cancel, on a departed borrower's behalf, every request of its the server has not answered."""
        for ident in sorted(borrower.outstanding, key=str):
            notice = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                      "params": {"requestId": ident, "reason": "the client went away"}}
            await borrower.served.send(_line(notice))
        borrower.outstanding.clear()

    async def stop(self, served: Served, drain_seconds: float = 0.0) -> list[dict[str, Any]]:
        """End a server for good: its input closed, then a signal if it lingers; its audit read to the
        end (``drain_seconds``) and returned; its files removed."""
        self.all.discard(served)
        for pool in self.idle.values():
            if served in pool:
                pool.remove(served)
        served.dead = True
        process = served.process
        if process.returncode is None:
            with contextlib.suppress(Exception):
                if process.stdin is not None:
                    process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), STOP_SECONDS)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), STOP_SECONDS)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    await process.wait()
        found: list[dict[str, Any]] = []
        if served.auditor is not None:
            await asyncio.to_thread(served.auditor.finish, drain_seconds)
            found = served.auditor.take()
            served.auditor.close()
        if served.egress is not None:
            served.egress.close()
        if served.status_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(served.status_path)
        return found

    def _top_up(self, spec: Spec) -> None:
        have = len(self.idle.get(spec.key, ())) + self._starting.get(spec.key, 0)
        for _ in range(max(0, self.spares - have)):
            self._starting[spec.key] = self._starting.get(spec.key, 0) + 1
            self._spawn(self._start_spare(spec))

    async def _start_spare(self, spec: Spec) -> None:
        try:
            served = await self.launch(spec)
        except Exception as exc:  # noqa: BLE001 - a spare that cannot start is only a missed warm start
            log.warning("spare server did not start: %s", exc, extra={"event": "session_host_spare_failed",
                                                                       "server": spec.server, "role": spec.role})
            return
        finally:
            self._starting[spec.key] -= 1
        self.idle.setdefault(spec.key, []).append(served)

    # --- loans --------------------------------------------------------------------------------------------

    async def checkout(self, spec: Spec) -> Borrower:
        pool = self.idle.setdefault(spec.key, [])
        served = None
        # A server an earlier borrower used first (its session is set up: warm), then a spare.
        pool.sort(key=lambda s: s.loans == 0)
        while pool:
            candidate = pool.pop(0)
            if not candidate.dead and candidate.process.returncode is None:
                served = candidate
                break
            await self.stop(candidate)
        if served is None:
            served = await self.launch(spec)
        served.loans += 1
        self._wanted[spec.key] = asyncio.get_running_loop().time()
        borrower = Borrower(served, secrets.token_urlsafe(24), (served.loans - 1) * ID_SPAN)
        served.borrower = borrower
        self.leases[borrower.lease] = borrower
        self._top_up(spec)
        return borrower

    async def end_loan(self, borrower: Borrower, retire: bool, drain_seconds: float = 0.0) -> list[dict[str, Any]]:
        """The borrower is done (released, retired, or gone): settle what it left in flight."""
        self.leases.pop(borrower.lease, None)
        served = borrower.served
        if served.borrower is not borrower:
            return []
        served.borrower = None
        if borrower.writer is not None:
            borrower.writer.close()
        await self._cancel_outstanding(borrower)
        for ident in sorted(borrower.asked, key=str):
            await served.send(_line({"jsonrpc": "2.0", "id": ident, "error": {
                "code": NO_BORROWER, "message": "the client went away"}}))
        if retire or served.broken or served.dead or served.process.returncode is not None:
            return await self.stop(served, drain_seconds)
        self.idle.setdefault(served.spec.key, []).append(served)
        return []

    # --- connections --------------------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await reader.readline()
        except (ValueError, ConnectionError):
            writer.close()
            return
        hello = _jsonrpc(first.rstrip(b"\n")) or {}
        if "attach" in hello:
            await self._data(hello["attach"], reader, writer)
        else:
            await self._control(hello, reader, writer)

    async def _data(self, lease: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        borrower = self.leases.get(lease) if isinstance(lease, str) else None
        if borrower is None or borrower.writer is not None:
            writer.close()
            return
        borrower.writer = writer
        borrower.attached.set()
        limit = borrower.served.spec.max_message_bytes
        line = Line(limit)
        try:
            while chunk := await reader.read(65536):
                done, line = split_lines(chunk, line)
                for complete in done:
                    if borrower.served.borrower is not borrower:
                        return  # the loan ended: nothing more of this borrower's reaches the server
                    raw = complete.raw()
                    if raw is not None:
                        await self._from_borrower(borrower, raw)
        except ConnectionError:
            pass
        finally:
            # The borrower's session ended (or it died): its requests are cancelled now; the loan
            # itself ends on its control connection.
            if borrower.served.borrower is borrower:
                await self._cancel_outstanding(borrower)
            writer.close()

    async def _control(self, request: dict[str, Any], reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        borrower: Borrower | None = None
        try:
            while request:
                answer, borrower = await self._answer(request, borrower)
                writer.write(_line(answer))
                await writer.drain()
                if request.get("op") in ("release", "retire"):
                    borrower = None
                raw = await reader.readline()
                request = _jsonrpc(raw.rstrip(b"\n")) or {}
        except (ConnectionError, ValueError):
            pass
        finally:
            if borrower is not None:  # the pool process went without a word: it was killed
                await self.end_loan(borrower, retire=False)
            writer.close()

    async def _answer(self, request: dict[str, Any], borrower: Borrower | None) -> tuple[dict[str, Any], Borrower | None]:
        op = request.get("op")
        try:
            if op == "checkout" and borrower is None:
                spec = Spec(**request["spec"])
                borrower = await self.checkout(spec)
                served = borrower.served
                return {"ok": True, "lease": borrower.lease, "id_base": borrower.id_base,
                        "status_path": served.status_path, "audited": served.auditor is not None,
                        "pid": served.process.pid, "loan": served.loans}, borrower
            if borrower is None:
                return {"ok": False, "error": f"{op!r} without a checkout"}, None
            served = borrower.served
            if op == "settle":
                if served.auditor is not None:
                    await asyncio.to_thread(served.auditor.settle)
                return {"ok": True, "armed": served.auditor is None or served.auditor.armed}, borrower
            if op == "take":
                found = await asyncio.to_thread(served.auditor.take) if served.auditor is not None else []
                counted, served.counted = served.counted, 0
                return {"ok": True, "found": found, "counted": counted}, borrower
            if op in ("release", "retire"):
                drain = float(request.get("drain_seconds") or 0.0)
                found = await self.end_loan(borrower, retire=op == "retire", drain_seconds=drain)
                counted, served.counted = served.counted, 0
                return {"ok": True, "found": found, "counted": counted}, None
        except Exception as exc:  # noqa: BLE001 - a bad request is answered, the host goes on
            log.warning("session host request failed: %s", exc, extra={"event": "session_host_refused", "op": op})
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, borrower
        return {"ok": False, "error": f"unknown request {op!r}"}, borrower

    async def _stop_unwanted(self) -> None:
        while True:
            await asyncio.sleep(UNWANTED_SECONDS / 10)
            now = asyncio.get_running_loop().time()
            for key, pool in list(self.idle.items()):
                if now - self._wanted.get(key, now) > UNWANTED_SECONDS:
                    for served in list(pool):
                        await self.stop(served)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def serve(self, ready_fd: int | None = None) -> None:
        server = await asyncio.start_unix_server(self._connection, self.socket_path, limit=MAX_CONTROL_BYTES)
        os.chmod(self.socket_path, 0o600)
        if ready_fd is not None:
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signo in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signo, stop.set)
        self._spawn(self._stop_unwanted())
        async with server:
            await stop.wait()
        for served in list(self.all):
            await self.stop(served)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m worker.session_host")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--spares", type=int, default=1)
    parser.add_argument("--ready-fd", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="[session-host %(process)d] %(levelname)s %(message)s")
    asyncio.run(Host(args.socket, args.spares).serve(args.ready_fd))


if __name__ == "__main__":
    main()
