"""A loopback TCP fault proxy whose mode can change while a call is in flight.

It sits between MCP clients (Celery workers) and an MCP server over streamable HTTP and injects
the network faults of row 8 of ``FAULTS.md``: delay, black-hole, TCP reset and refused
connections. A mode switch applies to connections that are already open (an HTTP keep-alive
connection reused by the client), not only to new ones.

Modes (``FaultProxy.set_mode(mode, **params)``):

``pass``
    forward bytes both ways.
``delay`` (``seconds=1.0``, ``direction="both"|"request"|"response"``)
    hold every chunk ``seconds`` after it arrived before forwarding it. The hold is computed
    when the chunk is due, so changing the mode releases (or holds) chunks already waiting.
``blackhole`` (``forward_close=True``)
    keep forwarding client→server bytes (the request reaches the server, which acts) and
    silently drop every server→client byte, including a close by the server; the client's
    connection stays open. With ``forward_close=False`` the client's close (FIN or RST) is held
    back too, as a real partition would lose it: the server is not told the client gave up
    until the mode changes (an event-stream MCP server cancels a running tool when the client
    disconnects; a plain-JSON one does not).
``reset`` (``after_request=False``)
    abort connections with a TCP RST (``SO_LINGER`` 0, then close): every open connection at
    once and every new one on accept. With ``after_request=True`` client→server bytes are
    forwarded and a connection is reset when the server starts to answer (data or close), so
    the write happened and the response is lost.
``refuse`` (``reset_open=False``)
    close the listening socket, so new connections get ``ECONNREFUSED``; the socket is opened
    again on the same port when the mode changes. Open connections keep forwarding unless
    ``reset_open=True``.

Another process can switch modes through a control file, polled every 50 ms: a JSON object
``{"mode": ..., <params>...}`` written atomically with :func:`write_mode`. From the shell::

    python -m proofline_kit.faults.proxy --listen 0 --target 127.0.0.1:8765 --control-file F

prints the listening port as the first line of stdout and runs until SIGTERM or SIGINT.

One thread runs a ``selectors`` loop over non-blocking sockets; buffers are bounded per
direction (reading from a side stops while its queue is full); ``stop()`` joins the thread and
closes every socket.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import logging
import math
import os
import queue
import selectors
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["DIRECTIONS", "MODES", "FaultProxy", "Mode", "main", "make_mode", "read_mode", "write_mode"]

log = logging.getLogger(__name__)

MODES = ("pass", "delay", "blackhole", "reset", "refuse")
DIRECTIONS = ("both", "request", "response")
_PARAMS: dict[str, frozenset[str]] = {
    "pass": frozenset(),
    "delay": frozenset({"seconds", "direction"}),
    "blackhole": frozenset({"forward_close"}),
    "reset": frozenset({"after_request"}),
    "refuse": frozenset({"reset_open"}),
}
#: Keys of a control file that are not mode parameters (``seq`` makes every write a new command).
_CONTROL_META = frozenset({"seq"})

CHUNK = 64 * 1024
DEFAULT_MAX_BUFFER = 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 1024
POLL_INTERVAL = 0.05
_IDLE_TIMEOUT = 0.5
_LISTEN_RETRY = 0.1
_RST_LINGER = struct.pack("ii", 1, 0)


@dataclass(frozen=True)
class Mode:
    """One fault mode with its parameters (build it with :func:`make_mode`)."""

    name: str = "pass"
    seconds: float = 0.0
    direction: str = "both"
    after_request: bool = False
    reset_open: bool = False
    forward_close: bool = True

    def delay_for(self, upstream: bool) -> float:
        """Seconds to hold a chunk travelling client→server (``upstream``) or server→client."""
        if self.name != "delay":
            return 0.0
        if self.direction == "both" or (self.direction == "request") == upstream:
            return self.seconds
        return 0.0

    def params(self) -> dict[str, Any]:
        """The parameters that :func:`make_mode` would take to rebuild this mode."""
        if self.name == "delay":
            return {"seconds": self.seconds, "direction": self.direction}
        if self.name == "reset":
            return {"after_request": self.after_request}
        if self.name == "refuse":
            return {"reset_open": self.reset_open}
        if self.name == "blackhole":
            return {"forward_close": self.forward_close}
        return {}


def _flag(mode: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{mode}: {name} must be true or false, not {value!r}")
    return value


def make_mode(mode: str, **params: Any) -> Mode:
    """Validate ``mode`` and its parameters; raises ``ValueError`` on anything unknown or out of range."""
    if mode not in MODES:
        raise ValueError(f"unknown fault mode {mode!r}; expected one of {', '.join(MODES)}")
    unknown = sorted(set(params) - _PARAMS[mode])
    if unknown:
        raise ValueError(f"{mode}: unknown parameter(s) {', '.join(unknown)}")
    if mode == "delay":
        seconds = params.get("seconds", 1.0)
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise ValueError(f"delay: seconds must be a number, not {seconds!r}")
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"delay: seconds must be finite and >= 0, not {seconds!r}")
        direction = params.get("direction", "both")
        if direction not in DIRECTIONS:
            raise ValueError(f"delay: direction must be one of {', '.join(DIRECTIONS)}, not {direction!r}")
        return Mode("delay", seconds=float(seconds), direction=direction)
    if mode == "reset":
        return Mode("reset", after_request=_flag(mode, "after_request", params.get("after_request", False)))
    if mode == "refuse":
        return Mode("refuse", reset_open=_flag(mode, "reset_open", params.get("reset_open", False)))
    if mode == "blackhole":
        return Mode("blackhole", forward_close=_flag(mode, "forward_close", params.get("forward_close", True)))
    return Mode(mode)


def _mode_from_doc(doc: Any) -> Mode:
    if not isinstance(doc, dict) or not isinstance(doc.get("mode"), str):
        raise ValueError(f"control file must hold a JSON object with a string 'mode', not {doc!r}")
    params = {k: v for k, v in doc.items() if k != "mode" and k not in _CONTROL_META}
    return make_mode(doc["mode"], **params)


_seq_lock = threading.Lock()
_seq_last = 0


def _next_seq() -> int:
    global _seq_last
    with _seq_lock:
        _seq_last = max(_seq_last + 1, time.time_ns())
        return _seq_last


def write_mode(control_file: str | os.PathLike[str], mode: str, **params: Any) -> None:
    """Atomically replace ``control_file`` with ``{"mode": mode, **params, "seq": ...}``.

    The parameters are validated first. ``seq`` changes on every write, so writing the same
    mode twice is applied twice (a second ``reset`` resets the connections opened meanwhile).
    """
    make_mode(mode, **params)
    path = Path(control_file)
    doc = {"mode": mode, **params, "seq": _next_seq()}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(doc, handle)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_mode(control_file: str | os.PathLike[str]) -> Mode | None:
    """The mode a control file asks for, or ``None`` if it does not exist."""
    try:
        text = Path(control_file).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    return _mode_from_doc(json.loads(text))


class _Pipe:
    """One direction of a connection: chunks waiting to be forwarded, with their arrival times."""

    __slots__ = ("queue", "queued", "eof", "error", "shut", "blocked")

    def __init__(self) -> None:
        self.queue: deque[list[Any]] = deque()  # [arrival monotonic time, bytes]
        self.queued = 0
        self.eof = False  # the source side closed (or failed, see ``error``)
        self.error = False  # the source side failed (reset): propagate as a reset
        self.shut = False  # the close has been passed on to the destination
        self.blocked = False  # the destination's send buffer was full at the last attempt

    def push(self, now: float, data: bytes) -> None:
        self.queue.append([now, data])
        self.queued += len(data)

    def clear(self) -> int:
        dropped = self.queued
        self.queue.clear()
        self.queued = 0
        self.blocked = False
        return dropped


class _Conn:
    __slots__ = ("id", "client", "server", "connecting", "up", "down", "awaiting_response", "c_events",
                 "s_events", "closed")

    def __init__(self, cid: int, client: socket.socket, server: socket.socket, connecting: bool) -> None:
        self.id = cid
        self.client = client
        self.server = server
        self.connecting = connecting
        self.up = _Pipe()  # client → server
        self.down = _Pipe()  # server → client
        self.awaiting_response = False
        self.c_events = 0
        self.s_events = 0
        self.closed = False


def _rst(sock: socket.socket) -> None:
    """Close ``sock`` so that the peer gets a TCP RST instead of a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST_LINGER)
    except OSError:
        pass
    sock.close()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_COUNTERS = (
    "connections_accepted",
    "connections_closed",
    "bytes_client_to_server",
    "bytes_server_to_client",
    "bytes_dropped",
    "responses_dropped",
    "resets_sent",
    "upstream_connect_failures",
    "mode_changes",
    "control_errors",
)


class FaultProxy:
    """A TCP proxy on a loopback port in front of ``target`` that injects network faults.

    ``FaultProxy(listen_port=0, target=("127.0.0.1", port))``; ``start()``/``stop()`` or use it as a
    context manager; ``.port`` is the port actually listened on (it never changes, even across
    ``refuse``); ``set_mode(mode, **params)`` takes effect on open connections before it returns;
    ``stats()`` returns the counters.
    """

    def __init__(
        self,
        listen_port: int = 0,
        target: tuple[str, int] | None = None,
        *,
        listen_host: str = "127.0.0.1",
        control_file: str | os.PathLike[str] | None = None,
        mode: str = "pass",
        max_buffer: int = DEFAULT_MAX_BUFFER,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        poll_interval: float = POLL_INTERVAL,
        **params: Any,
    ) -> None:
        if target is None:
            raise TypeError("FaultProxy needs target=(host, port)")
        if not _is_loopback(listen_host):
            raise ValueError(f"the fault proxy listens on loopback only, not {listen_host!r}")
        if max_buffer < 1 or max_connections < 1 or poll_interval <= 0:
            raise ValueError("max_buffer, max_connections and poll_interval must be positive")
        self.target = (str(target[0]), int(target[1]))
        self.listen_host = listen_host
        self.control_file = Path(control_file) if control_file is not None else None
        self.max_buffer = max_buffer
        self.max_connections = max_connections
        self.poll_interval = poll_interval
        self._port = int(listen_port)
        self._mode = make_mode(mode, **params)
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._commands: queue.SimpleQueue[tuple[Mode, threading.Event]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self._sel: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        self._next_id = 0
        self._control_doc: Any = None
        self._next_poll = 0.0
        self._next_listen_try = 0.0
        self._listen_family = socket.AF_INET6 if ":" in listen_host else socket.AF_INET
        self._target_addr: tuple[int, Any] | None = None

    # --- public API ---------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The port the proxy listens on (resolved from 0 by ``start()``)."""
        if not self._started and not self._port:
            raise RuntimeError("the proxy is not started; its port is not known yet")
        return self._port

    @property
    def address(self) -> tuple[str, int]:
        return (self.listen_host, self.port)

    @property
    def mode(self) -> Mode:
        return self._mode

    def start(self) -> FaultProxy:
        """Bind the listening socket, apply the control file if it exists, start the loop thread."""
        if self._started:
            raise RuntimeError("the proxy was already started")
        info = socket.getaddrinfo(self.target[0], self.target[1], type=socket.SOCK_STREAM)
        self._target_addr = (info[0][0], info[0][4])
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        try:
            for sock in (self._wake_r, self._wake_w):
                sock.setblocking(False)
            self._sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
            self._open_listener()
            self._started = True
            if self.control_file is not None:
                self._poll_control_file(time.monotonic(), force=True)
            if self._mode.name == "refuse":
                self._close_listener()
            self._thread = threading.Thread(target=self._run, name=f"fault-proxy-{self._port}", daemon=True)
            self._thread.start()
        except BaseException:
            self._close_everything()
            raise
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the loop, close every socket and join the thread (idempotent)."""
        thread = self._thread
        if thread is None:
            self._close_everything()
            return
        self._stopping.set()
        self._wake()
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"fault proxy thread did not stop within {timeout} s")

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def set_mode(self, mode: str, **params: Any) -> None:
        """Switch to ``mode``; when this returns, open connections and the listener follow it."""
        new = make_mode(mode, **params)
        thread = self._thread
        if threading.current_thread() is thread:
            self._apply_mode(new)
            return
        if thread is None or not thread.is_alive() or self._stopping.is_set():
            self._mode = new  # not running: the mode applies from start() on
            return
        done = threading.Event()
        self._commands.put((new, done))
        self._wake()
        deadline = time.monotonic() + 5.0
        while not done.wait(0.05):
            if not thread.is_alive():
                self._mode = new
                return
            if time.monotonic() > deadline:
                raise RuntimeError("fault proxy did not apply the mode change within 5 s")

    def stats(self) -> dict[str, Any]:
        """Counters plus the current mode, its parameters, the port and whether it is listening.

        ``bytes_client_to_server`` / ``bytes_server_to_client`` count bytes forwarded;
        ``bytes_dropped`` server→client bytes discarded by ``blackhole``; ``responses_dropped``
        bursts of server→client data discarded after the client had sent something (about one
        per HTTP response); ``resets_sent`` connections aborted by ``reset`` (or
        ``refuse`` with ``reset_open``); ``upstream_connect_failures`` accepted connections
        reset because the target could not be reached.
        """
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
        out["connections_open"] = len(self._conns)
        out["mode"] = self._mode.name
        out["params"] = self._mode.params()
        out["port"] = self._port
        out["listening"] = self._listener is not None
        return out

    # --- loop ---------------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _wake(self) -> None:
        sock = self._wake_w
        if sock is None:
            return
        try:
            sock.send(b"\0")
        except (BlockingIOError, InterruptedError, OSError):
            pass

    def _run(self) -> None:
        sel = self._sel
        assert sel is not None
        try:
            while not self._stopping.is_set():
                self._drain_commands()
                now = time.monotonic()
                self._poll_control_file(now)
                self._retry_listener(now)
                for conn in list(self._conns.values()):
                    self._service(conn, now)
                timeout = self._next_timeout(now)
                for key, mask in sel.select(timeout):
                    kind, conn = key.data
                    if kind == "wake":
                        self._drain_wake()
                    elif kind == "listen":
                        self._accept()
                    elif not conn.closed:
                        try:
                            self._on_event(conn, key.fileobj, mask)
                        except Exception:
                            log.exception("fault proxy: connection %d failed; aborting it", conn.id)
                            self._abort(conn)
        except Exception:
            log.exception("fault proxy loop crashed")
        finally:
            self._close_everything()

    def _drain_wake(self) -> None:
        assert self._wake_r is not None
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _drain_commands(self) -> None:
        while True:
            try:
                mode, done = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                self._apply_mode(mode)
            except Exception:
                log.exception("fault proxy: applying %s failed", mode)
            finally:
                done.set()

    def _next_timeout(self, now: float) -> float:
        timeout = _IDLE_TIMEOUT
        if self.control_file is not None:
            timeout = min(timeout, self._next_poll - now)
        if self._listener is None and self._mode.name != "refuse":
            timeout = min(timeout, self._next_listen_try - now)
        mode = self._mode
        for conn in self._conns.values():
            for upstream, pipe in ((True, conn.up), (False, conn.down)):
                if not pipe.queue or pipe.blocked or (upstream and conn.connecting):
                    continue
                timeout = min(timeout, pipe.queue[0][0] + mode.delay_for(upstream) - now)
        return max(0.0, timeout)

    # --- listener -----------------------------------------------------------------------------
    def _open_listener(self) -> None:
        assert self._sel is not None
        sock = socket.socket(self._listen_family, socket.SOCK_STREAM)
        try:
            # Accepted sockets inherit SO_REUSEADDR, so the port can be bound again after
            # ``refuse`` while connections accepted on it are still open.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.listen_host, self._port))
            sock.listen(128)
            sock.setblocking(False)
            self._sel.register(sock, selectors.EVENT_READ, ("listen", None))
        except BaseException:
            sock.close()
            raise
        self._port = sock.getsockname()[1]
        self._listener = sock

    def _close_listener(self) -> None:
        sock, self._listener = self._listener, None
        if sock is None:
            return
        if self._sel is not None:
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass
        sock.close()

    def _retry_listener(self, now: float) -> None:
        if self._listener is not None or self._mode.name == "refuse" or now < self._next_listen_try:
            return
        try:
            self._open_listener()
            log.info("fault proxy listening again on port %d", self._port)
        except OSError as exc:
            self._next_listen_try = now + _LISTEN_RETRY
            log.warning("fault proxy: cannot listen on port %d again yet: %s", self._port, exc)

    # --- modes --------------------------------------------------------------------------------
    def _apply_mode(self, new: Mode) -> None:
        self._mode = new
        self._count("mode_changes")
        log.info("fault proxy on port %d: mode %s %s", self._port, new.name, new.params())
        if new.name == "refuse":
            self._close_listener()
        elif self._listener is None:
            self._next_listen_try = 0.0
            self._retry_listener(time.monotonic())
        conns = list(self._conns.values())
        if new.name == "blackhole":
            for conn in conns:
                dropped = conn.down.clear()
                if dropped:
                    self._count("bytes_dropped", dropped)
                    self._count("responses_dropped")
        elif new.name == "reset":
            for conn in conns:
                if not new.after_request or conn.down.queue or conn.down.eof:
                    self._reset(conn)
        elif new.name == "refuse" and new.reset_open:
            for conn in conns:
                self._reset(conn)

    def _poll_control_file(self, now: float, force: bool = False) -> None:
        if self.control_file is None or (now < self._next_poll and not force):
            return
        self._next_poll = now + self.poll_interval
        try:
            text = self.control_file.read_text(encoding="utf-8")
        except OSError:
            return  # missing or unreadable: keep the current mode
        try:
            doc = json.loads(text)
        except ValueError:
            return  # a non-atomic writer may be half way: look again at the next poll
        if doc == self._control_doc:
            return
        self._control_doc = doc
        try:
            mode = _mode_from_doc(doc)
        except ValueError as exc:
            self._count("control_errors")
            log.warning("fault proxy: ignoring control file %s: %s", self.control_file, exc)
            return
        self._apply_mode(mode)

    # --- connections --------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(64):
            listener = self._listener
            if listener is None:
                return
            try:
                client, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("fault proxy: accept failed: %s", exc)
                return
            self._count("connections_accepted")
            mode = self._mode
            if (mode.name == "reset" and not mode.after_request) or len(self._conns) >= self.max_connections:
                self._count("resets_sent")
                _rst(client)
                continue
            self._connect_upstream(client)

    def _connect_upstream(self, client: socket.socket) -> None:
        assert self._target_addr is not None
        family, addr = self._target_addr
        client.setblocking(False)
        server = socket.socket(family, socket.SOCK_STREAM)
        try:
            server.setblocking(False)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            err = server.connect_ex(addr)
        except OSError as exc:
            err = exc.errno or errno.EIO
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            log.warning("fault proxy: cannot connect to %s:%d: %s", *self.target, os.strerror(err))
            self._count("upstream_connect_failures")
            server.close()
            _rst(client)
            return
        self._next_id += 1
        conn = _Conn(self._next_id, client, server, connecting=err != 0)
        self._conns[conn.id] = conn
        self._update_interest(conn)

    def _on_event(self, conn: _Conn, sock: Any, mask: int) -> None:
        if sock is conn.server and conn.connecting:
            err = conn.server.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                log.warning("fault proxy: cannot connect to %s:%d: %s", *self.target, os.strerror(err))
                self._count("upstream_connect_failures")
                self._abort(conn)
                return
            conn.connecting = False
        if mask & selectors.EVENT_READ:
            self._read(conn, upstream=sock is conn.client)
        if not conn.closed and mask & selectors.EVENT_WRITE:
            # Writable again: let ``_service`` try the due chunks now.
            (conn.up if sock is conn.server else conn.down).blocked = False
        if not conn.closed:
            self._service(conn, time.monotonic())

    def _read(self, conn: _Conn, upstream: bool) -> None:
        src, pipe = (conn.client, conn.up) if upstream else (conn.server, conn.down)
        try:
            data = src.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
            pipe.error = True
        mode = self._mode
        if upstream:
            if data:
                pipe.push(time.monotonic(), data)
                conn.awaiting_response = True
            else:
                pipe.eof = True
            return
        if mode.name == "reset" and mode.after_request:
            # The server has started to answer (or closed): the request got through; lose the answer.
            self._reset(conn)
            return
        if mode.name == "blackhole":
            if data:
                self._count("bytes_dropped", len(data))
                if conn.awaiting_response:
                    conn.awaiting_response = False
                    self._count("responses_dropped")
            else:
                pipe.eof = True
            return
        if data:
            pipe.push(time.monotonic(), data)
            conn.awaiting_response = False
        else:
            pipe.eof = True

    def _flush(self, conn: _Conn, upstream: bool, now: float) -> None:
        pipe, dst = (conn.up, conn.server) if upstream else (conn.down, conn.client)
        if pipe.blocked:
            return
        delay = self._mode.delay_for(upstream)
        counter = "bytes_client_to_server" if upstream else "bytes_server_to_client"
        while pipe.queue:
            item = pipe.queue[0]
            if item[0] + delay > now:
                return
            try:
                sent = dst.send(item[1])
            except (BlockingIOError, InterruptedError):
                pipe.blocked = True
                return
            except OSError:
                self._abort(conn)
                return
            self._count(counter, sent)
            pipe.queued -= sent
            if sent < len(item[1]):
                item[1] = item[1][sent:]
                pipe.blocked = True
                return
            pipe.queue.popleft()

    def _service(self, conn: _Conn, now: float) -> None:
        """Forward what is due, pass closes on, and update what the selector waits for."""
        if conn.closed:
            return
        if not conn.connecting:
            self._flush(conn, True, now)
        if not conn.closed:
            self._flush(conn, False, now)
        if conn.closed:
            return
        up, down = conn.up, conn.down
        mode = self._mode
        hide = mode.name == "blackhole"
        hold_close = hide and not mode.forward_close
        try:
            if up.eof and not up.queue and not up.shut and not conn.connecting and not hold_close:
                if up.error:
                    self._abort(conn)
                    return
                conn.server.shutdown(socket.SHUT_WR)
                up.shut = True
            if down.eof and not down.queue and not down.shut:
                if hide:
                    if up.eof and not up.queue:
                        self._close(conn)  # both ends are gone: nothing left to hide
                        return
                elif down.error:
                    self._abort(conn)
                    return
                else:
                    conn.client.shutdown(socket.SHUT_WR)
                    down.shut = True
        except OSError:
            self._abort(conn)
            return
        if up.shut and down.shut:
            self._close(conn)
            return
        self._update_interest(conn)

    def _update_interest(self, conn: _Conn) -> None:
        c_events = 0
        if not conn.up.eof and conn.up.queued < self.max_buffer:
            c_events |= selectors.EVENT_READ
        if conn.down.blocked:
            c_events |= selectors.EVENT_WRITE
        if conn.connecting:
            s_events = selectors.EVENT_WRITE
        else:
            s_events = 0
            if not conn.down.eof and conn.down.queued < self.max_buffer:
                s_events |= selectors.EVENT_READ
            if conn.up.blocked:
                s_events |= selectors.EVENT_WRITE
        conn.c_events = self._set_events(conn.client, conn.c_events, c_events, conn)
        conn.s_events = self._set_events(conn.server, conn.s_events, s_events, conn)

    def _set_events(self, sock: socket.socket, current: int, events: int, conn: _Conn) -> int:
        assert self._sel is not None
        if events == current:
            return current
        if current == 0:
            self._sel.register(sock, events, ("conn", conn))
        elif events == 0:
            self._sel.unregister(sock)
        else:
            self._sel.modify(sock, events, ("conn", conn))
        return events

    def _forget(self, conn: _Conn) -> bool:
        if conn.closed:
            return False
        conn.closed = True
        self._conns.pop(conn.id, None)
        for sock, events in ((conn.client, conn.c_events), (conn.server, conn.s_events)):
            if events and self._sel is not None:
                try:
                    self._sel.unregister(sock)
                except (KeyError, ValueError):
                    pass
        conn.c_events = conn.s_events = 0
        self._count("connections_closed")
        return True

    def _close(self, conn: _Conn) -> None:
        if self._forget(conn):
            conn.client.close()
            conn.server.close()

    def _abort(self, conn: _Conn) -> None:
        """Close both sides with a RST (a failure on one side is passed on as a reset)."""
        if self._forget(conn):
            _rst(conn.client)
            _rst(conn.server)

    def _reset(self, conn: _Conn) -> None:
        """An injected reset: counted in ``resets_sent``."""
        if not conn.closed:
            self._count("resets_sent")
            self._abort(conn)

    def _close_everything(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn)
        self._close_listener()
        for sock in (self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._wake_r = self._wake_w = None
        if self._sel is not None:
            self._sel.close()
            self._sel = None
        while True:  # release anyone still waiting in set_mode
            try:
                _mode, done = self._commands.get_nowait()
            except queue.Empty:
                break
            done.set()


# --- command line ---------------------------------------------------------------------------------
def _target(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, not {text!r}")
    return host.strip("[]"), int(port)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a proxy until SIGTERM/SIGINT; the first line of stdout is the port it listens on."""
    parser = argparse.ArgumentParser(prog="python -m proofline_kit.faults.proxy", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=int, default=0, help="port to listen on (0: any free port)")
    parser.add_argument("--listen-host", default="127.0.0.1")
    parser.add_argument("--target", type=_target, required=True, help="HOST:PORT of the server")
    parser.add_argument("--control-file", default=None, help="JSON file polled for mode changes")
    parser.add_argument("--mode", default="pass", choices=MODES, help="initial mode (parameters: control file)")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    proxy = FaultProxy(args.listen, args.target, listen_host=args.listen_host, control_file=args.control_file,
                       mode=args.mode)
    proxy.start()
    try:
        print(proxy.port, flush=True)
        while not stop.wait(0.2):
            pass
    finally:
        proxy.stop()
    print(json.dumps(proxy.stats()), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
