"""A counting TCP proxy for the Postgres frontend/backend protocol (version 3).

``pg_stat_statements`` needs ``shared_preload_libraries`` (a server restart), so round trips and
statements are counted on the wire instead: clients connect to this proxy, which forwards every
byte unchanged and parses the message framing on both directions.

What is counted, per connection and summed per *role* (from the startup ``application_name``):

- ``statements``: ``Query`` (simple protocol) plus ``Execute`` (extended protocol) messages;
- ``round_trips``: client flights, i.e. a ``Sync``/``Query`` sent while the client had no earlier
  sync point outstanding. A pipeline of several syncs sent before the first answer is one flight;
- ``transactions``: top-level transactions that ended, read from ``ReadyForQuery``: a status of
  ``I`` (idle) after any command since the previous idle one. An autocommit statement is one
  transaction; ``BEGIN ... COMMIT`` is one. This is what ``pg_stat_database.xact_commit`` and
  ``xact_rollback`` count, minus the one internal transaction Postgres runs per new connection;
- ``commits`` / ``rollbacks``: those transactions by how they ended;
- ``write_transactions``: transactions in which an ``INSERT``/``UPDATE``/``DELETE``/``MERGE``
  command tag reported at least one row (the ones that were assigned a transaction id);
- ``begins``: explicit ``BEGIN`` statements.

It does not support TLS (clients must not get ``S`` to an ``SSLRequest``; Postgres here runs with
``ssl = off``, and the bench also sets ``sslmode=disable``). The proxy runs on its own event loop
thread; the caller reads counters with :meth:`CountingProxy.snapshot`.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
CANCEL_REQUEST = 80877102
PROTOCOL_3 = 196608
WRITE_TAGS = ("INSERT", "UPDATE", "DELETE", "MERGE")
TRACE_LIMIT = 400


@dataclass
class Counts:
    connections: int = 0
    statements: int = 0
    round_trips: int = 0
    sync_points: int = 0
    transactions: int = 0
    commits: int = 0
    rollbacks: int = 0
    write_transactions: int = 0
    begins: int = 0
    bytes_to_server: int = 0
    bytes_to_client: int = 0
    parse_errors: int = 0

    def add(self, other: Counts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def minus(self, other: Counts) -> Counts:
        return Counts(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _cstrings(payload: bytes) -> list[str]:
    return [part.decode("utf-8", "replace") for part in payload.split(b"\0")]


class _Connection:
    """Parser state of one proxied connection (both directions)."""

    def __init__(self, proxy: CountingProxy) -> None:
        self.proxy = proxy
        self.role = "unknown"
        self.counts = Counts(connections=1)
        self.client_buf = bytearray()
        self.server_buf = bytearray()
        self.startup = True
        self.single_byte_answers = 0
        self.opaque = False
        self.outstanding = 0
        self.active = False
        self.wrote = False
        self.failed = False
        self.last_tag = ""
        self.prepared: dict[str, str] = {}
        self.unnamed = ""
        self.bound = ""

    # --- client -> server --------------------------------------------------------------------
    def from_client(self, data: bytes) -> None:
        self.counts.bytes_to_server += len(data)
        buf = self.client_buf
        buf.extend(data)
        while True:
            if self.startup:
                if len(buf) < 8:
                    return
                length, code = struct.unpack("!ii", buf[:8])
                if len(buf) < length:
                    return
                body = bytes(buf[8:length])
                del buf[:length]
                if code in (SSL_REQUEST, GSSENC_REQUEST):
                    self.single_byte_answers += 1
                elif code == PROTOCOL_3:
                    parts = _cstrings(body)
                    params = dict(zip(parts[0::2], parts[1::2], strict=False))
                    self.role = self.proxy.classify(params.get("application_name", ""))
                    self.startup = False
                continue
            if len(buf) < 5:
                return
            kind = chr(buf[0])
            (length,) = struct.unpack("!i", buf[1:5])
            if len(buf) < 1 + length:
                return
            payload = bytes(buf[5:1 + length])
            del buf[:1 + length]
            self._client_message(kind, payload)

    def _sync_point(self) -> None:
        self.counts.sync_points += 1
        if self.outstanding == 0:
            self.counts.round_trips += 1
        self.outstanding += 1

    def _client_message(self, kind: str, payload: bytes) -> None:
        if kind == "Q":
            sql = payload.rstrip(b"\0").decode("utf-8", "replace")
            self.counts.statements += 1
            if sql.strip().upper().startswith("BEGIN"):
                self.counts.begins += 1
            self._trace("Q", sql)
            self._sync_point()
        elif kind == "P":
            parts = _cstrings(payload)
            name, sql = parts[0], parts[1] if len(parts) > 1 else ""
            if name:
                self.prepared[name] = sql
            else:
                self.unnamed = sql
        elif kind == "B":
            parts = payload.split(b"\0", 2)
            statement = parts[1].decode("utf-8", "replace") if len(parts) > 1 else ""
            self.bound = self.prepared.get(statement, "?") if statement else self.unnamed
        elif kind == "E":
            self.counts.statements += 1
            if self.bound.strip().upper().startswith("BEGIN"):
                self.counts.begins += 1
            self._trace("E", self.bound)
        elif kind == "S":
            self._sync_point()

    # --- server -> client --------------------------------------------------------------------
    def from_server(self, data: bytes) -> None:
        self.counts.bytes_to_client += len(data)
        buf = self.server_buf
        buf.extend(data)
        while True:
            if self.single_byte_answers:
                if not buf:
                    return
                answer = chr(buf[0])
                del buf[:1]
                self.single_byte_answers -= 1
                if answer in "SG":
                    self.opaque = True  # encrypted from here on: nothing more can be parsed
                    return
                continue
            if len(buf) < 5:
                return
            kind = chr(buf[0])
            (length,) = struct.unpack("!i", buf[1:5])
            if len(buf) < 1 + length:
                return
            payload = bytes(buf[5:1 + length])
            del buf[:1 + length]
            self._server_message(kind, payload)

    def _server_message(self, kind: str, payload: bytes) -> None:
        if kind == "C":
            tag = payload.rstrip(b"\0").decode("utf-8", "replace")
            self.active = True
            self.last_tag = tag
            words = tag.split()
            if words and words[0] in WRITE_TAGS and words[-1].isdigit() and int(words[-1]) > 0:
                self.wrote = True
        elif kind == "E":
            self.active = True
            self.failed = True
        elif kind == "Z":
            self.outstanding = max(0, self.outstanding - 1)
            status = chr(payload[0]) if payload else "I"
            if status != "I":
                self.active = True
                return
            if self.active:
                c = self.counts
                c.transactions += 1
                if self.failed or self.last_tag == "ROLLBACK":
                    c.rollbacks += 1
                else:
                    c.commits += 1
                    if self.wrote:
                        c.write_transactions += 1
                self._trace("Z", "commit" if not (self.failed or self.last_tag == "ROLLBACK") else "rollback",
                            wrote=self.wrote)
            self.active = self.wrote = self.failed = False
            self.last_tag = ""

    def _trace(self, kind: str, text: str, **extra: Any) -> None:
        trace = self.proxy.trace
        if trace is not None and len(trace) < TRACE_LIMIT:
            trace.append({"role": self.role, "conn": id(self) % 100000, "kind": kind,
                          "sql": " ".join(text.split())[:160], **extra})


class CountingProxy:
    """Listen on 127.0.0.1 (a free port) and forward to ``upstream``; count what passes."""

    def __init__(self, upstream_host: str, upstream_port: int,
                 classify: Callable[[str], str] = lambda name: name or "unnamed") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.classify = classify
        self.port: int | None = None
        self.trace: list[dict[str, Any]] | None = None
        self._conns: list[_Connection] = []
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="pgwire-proxy", daemon=True)
        self.native_thread_id: int | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> int:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        self.native_thread_id = self._call(threading.get_native_id)
        return self.port

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _call(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    # --- reading -----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Counts]:
        """Counters summed per role, read on the proxy's own thread (a consistent cut)."""

        def collect() -> dict[str, Counts]:
            totals: dict[str, Counts] = {}
            for conn in self._conns:
                totals.setdefault(conn.role, Counts()).add(conn.counts)
            return totals

        return self._call(collect)

    def start_trace(self) -> None:
        self._call(lambda: setattr(self, "trace", []))

    def stop_trace(self) -> list[dict[str, Any]]:
        def take() -> list[dict[str, Any]]:
            trace, self.trace = self.trace or [], None
            return trace

        return self._call(take)

    # --- forwarding --------------------------------------------------------------------------
    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        conn = _Connection(self)
        self._conns.append(conn)

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, feed: Callable[[bytes], None]) -> None:
            try:
                while True:
                    data = await reader.read(65536)
                    if not data:
                        break
                    if not conn.opaque:
                        try:
                            feed(data)
                        except Exception:  # noqa: BLE001 - never break forwarding over a counting bug
                            conn.opaque = True
                            conn.counts.parse_errors += 1
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                try:
                    writer.close()
                except Exception:  # noqa: BLE001
                    pass

        try:
            await asyncio.gather(pump(client_reader, server_writer, conn.from_client),
                                 pump(server_reader, client_writer, conn.from_server))
        except asyncio.CancelledError:  # the proxy is stopping
            # Ending normally (not cancelled) keeps asyncio's stream callback from logging an error.
            for writer in (client_writer, server_writer):
                writer.close()


def per_role_delta(after: dict[str, Counts], before: dict[str, Counts]) -> dict[str, Counts]:
    return {role: counts.minus(before.get(role, Counts())) for role, counts in after.items()}
