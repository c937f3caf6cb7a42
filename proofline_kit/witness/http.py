"""The streamable-HTTP relay: a loopback TCP relay that reads the HTTP it forwards.

Bytes go through unchanged in both directions (keep-alive, chunked bodies, event streams, resets
and half-closes included); a passive HTTP/1.1 parser (h11) follows each direction on the side to
find the JSON-RPC messages in request bodies and in responses (plain JSON or ``text/event-stream``).
As in the stdio relay, a message is recorded before the chunk that completes it is forwarded.

The relay connects to the server before it reads anything from the client: when the server does
not accept, the client's connection is reset unread, so no request is recorded that the server
could not have received. A reset on one side is passed on as a reset to the other.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import zlib
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from pathlib import Path

import h11

from proofline_kit.witness.record import Observer, OpenCalls, RecordWriter, parse

CHUNK = 64 * 1024
BODY_LIMIT = 16 * 1024 * 1024


class _Side(ABC):
    """One direction of one connection, parsed message by message (a fresh h11 state machine per
    message: the relay never answers, so h11's request/response cycle is not ours to advance)."""

    def __init__(self, deliver: Callable[[object], None]) -> None:
        self.deliver = deliver
        self.conn: h11.Connection | None = None
        self.body = bytearray()
        self.events = bytearray()
        self.stream = False
        self.gzip = False
        self.broken = False

    @abstractmethod
    def new_connection(self) -> h11.Connection:
        """A parser positioned to read the next message of this direction."""

    def feed(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            self._feed(data)
        except h11.ProtocolError:
            self.broken = True  # not HTTP we understand: forward, record nothing more

    def _feed(self, data: bytes) -> None:
        if self.conn is None:
            self.conn = self.new_connection()
        self.conn.receive_data(data)
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                return
            if isinstance(event, (h11.Request, h11.Response)):
                self._start(event)
            elif isinstance(event, h11.Data):
                self._data(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self._end()
                rest, closed = self.conn.trailing_data
                self.conn = self.new_connection()
                if rest or closed:
                    self.conn.receive_data(bytes(rest) if rest else b"")
                    if closed:
                        self.conn.receive_data(b"")

    def _start(self, event: h11.Request | h11.Response) -> None:
        headers = {k.lower(): v.lower() for k, v in event.headers}
        self.body.clear()
        self.events.clear()
        self.stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        self.gzip = headers.get(b"content-encoding", b"") in (b"gzip", b"deflate")

    def _data(self, data: bytes) -> None:
        if self.stream:
            self.events += data.replace(b"\r\n", b"\n")
            while b"\n\n" in self.events:
                event, _, rest = bytes(self.events).partition(b"\n\n")
                self.events = bytearray(rest)
                payload = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
                self._message(payload)
        elif len(self.body) + len(data) <= BODY_LIMIT:
            self.body += data

    def _end(self) -> None:
        if not self.stream and self.body:
            body = bytes(self.body)
            if self.gzip:
                try:
                    body = zlib.decompress(body, 47)  # gzip or zlib header, detected
                except zlib.error:
                    return
            self._message(body)

    def _message(self, payload: bytes) -> None:
        message = parse(payload) if payload else None
        if message is not None:
            self.deliver(message)


class _Requests(_Side):
    def __init__(self, observer: Observer, methods: deque[bytes]) -> None:
        super().__init__(observer.client)
        self.observer, self.methods = observer, methods

    def new_connection(self) -> h11.Connection:
        return h11.Connection(h11.SERVER)

    def _start(self, event: h11.Request | h11.Response) -> None:
        if isinstance(event, h11.Request):
            self.methods.append(event.method)
            sessions = [v.decode("latin-1") for k, v in event.headers if k.lower() == b"mcp-session-id"]
            self.observer.session = sessions[0] if sessions else None
        super()._start(event)


class _Responses(_Side):
    def __init__(self, deliver: Callable[[object], None], methods: deque[bytes]) -> None:
        super().__init__(deliver)
        self.methods = methods

    def new_connection(self) -> h11.Connection:
        # h11 frames a response by the request it answers (a HEAD response has no body): replay it.
        conn = h11.Connection(h11.CLIENT)
        method = self.methods.popleft() if self.methods else b"POST"
        conn.send(h11.Request(method=method, target="/", headers=[("Host", "witness"), ("Content-Length", "0")]))
        conn.send(h11.EndOfMessage())
        return conn


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST, as a reset peer would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, side: _Side,
                other: asyncio.StreamWriter, on_eof: Callable[[], None] = lambda: None) -> None:
    while True:
        try:
            chunk = await reader.read(CHUNK)
        except (ConnectionError, OSError):
            on_eof()  # the reading side went away (reset): the writing side is reset too
            _reset(writer)
            _reset(other)
            return
        if not chunk:
            break
        side.feed(chunk)
        try:
            writer.write(chunk)
            await writer.drain()
        except (ConnectionError, OSError):
            _reset(writer)
            _reset(other)
            return
    on_eof()
    side.feed(b"")
    if writer.can_write_eof() and not writer.is_closing():
        try:
            writer.write_eof()
        except OSError:
            pass


class HttpRelay:
    """Listens on loopback, relays each connection to the upstream server and records its calls.

    ``upstream`` is ``(host, port)``; with ``upstream_port_file`` the port is read from that file
    for each new connection (the server may restart on another port)."""

    def __init__(self, writer: RecordWriter, name: str, upstream: tuple[str, int] | None,
                 upstream_port_file: Path | None = None) -> None:
        self.writer, self.name = writer, name
        self.upstream, self.upstream_port_file = upstream, upstream_port_file
        self.open_calls = OpenCalls()

    def target(self) -> tuple[str, int]:
        if self.upstream_port_file is not None:
            return "127.0.0.1", int(self.upstream_port_file.read_text().strip())
        assert self.upstream is not None
        return self.upstream

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target())
        except (OSError, ValueError):
            _reset(writer)
            return
        observer = Observer(self.writer, self.name, "http", self.open_calls)
        methods: deque[bytes] = deque()
        try:
            await asyncio.gather(_pipe(reader, up_writer, _Requests(observer, methods), writer,
                                       observer.client_closed),
                                 _pipe(up_reader, writer, _Responses(observer.server, methods), up_writer))
        finally:
            observer.close()
            for w in (writer, up_writer):
                w.close()

    async def serve(self, host: str, port: int, on_bound: Callable[[int], None]) -> None:
        server = await asyncio.start_server(self.handle, host, port)
        on_bound(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()
