"""The loopback fault proxy against a tiny echo server: every mode, switched on open connections."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from proofline_kit import processes
from proofline_kit.faults import FaultProxy, make_mode, read_mode, write_mode

REPO = Path(__file__).resolve().parents[2]


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    return processes.wait_for(predicate, timeout, interval=0.01, what=what)


class EchoServer:
    """Echoes every chunk back and records what it received (the 'server acted' signal)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.eofs = 0
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.conns: list[socket.socket] = []
        self.accepter = threading.Thread(target=self._accept, daemon=True)
        self.accepter.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                    if not data:
                        with self.lock:
                            self.eofs += 1
                        return
                    with self.lock:
                        self.received += data
                    conn.sendall(data)
                except OSError:
                    return

    def got(self, data: bytes) -> bool:
        with self.lock:
            return data in self.received

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        self.sock.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self.accepter.join(2)
        for t in self.threads:
            t.join(2)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def proxy(echo: EchoServer) -> Iterator[FaultProxy]:
    with FaultProxy(listen_port=0, target=("127.0.0.1", echo.port)) as p:
        name = f"fault-proxy-{p.port}"
        yield p
    # Only this proxy's thread matters: other proxies (a session-wide test stack's) may be running.
    assert not any(t.name == name for t in threading.enumerate())


def connect(proxy: FaultProxy, timeout: float = 5.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)
    return s


def roundtrip(s: socket.socket, data: bytes) -> bytes:
    s.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_pass_forwards_both_ways(proxy: FaultProxy) -> None:
    with connect(proxy) as s:
        assert roundtrip(s, b"hello") == b"hello"
        big = os.urandom(3 * 1024 * 1024)  # larger than the buffer bound: back-pressure, not loss
        sender = threading.Thread(target=s.sendall, args=(big,))
        sender.start()
        got = bytearray()
        while len(got) < len(big):
            got += s.recv(1 << 20)
        sender.join(5)
        assert bytes(got) == big
    # Each pump counts a chunk after it has forwarded it: the last count may trail the bytes a moment.
    expected = 5 + len(big)

    def counted() -> dict | None:
        now = proxy.stats()
        return now if now["bytes_client_to_server"] == now["bytes_server_to_client"] == expected else None

    stats = wait_for(counted, 10, what=f"{expected} bytes counted each way")
    assert stats["connections_accepted"] == 1
    assert stats["mode"] == "pass" and stats["listening"] is True


def test_close_is_passed_on(proxy: FaultProxy) -> None:
    with connect(proxy) as s:
        assert roundtrip(s, b"bye") == b"bye"
        s.shutdown(socket.SHUT_WR)
        assert s.recv(10) == b""  # the echo server saw EOF and closed; the FIN came back
    wait_for(lambda: proxy.stats()["connections_open"] == 0, what="the connection to be closed")


def test_blackhole_server_receives_but_client_gets_nothing(proxy: FaultProxy, echo: EchoServer) -> None:
    with connect(proxy) as s:
        assert roundtrip(s, b"warm") == b"warm"
        proxy.set_mode("blackhole")  # on the open connection
        s.sendall(b"write-1")
        wait_for(lambda: echo.got(b"write-1"), what="the server to receive the request")
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(100)
        wait_for(lambda: proxy.stats()["responses_dropped"] >= 1, what="the dropped response to be counted")
        assert proxy.stats()["bytes_dropped"] >= len(b"write-1")
        # The connection stayed open: healed, it forwards again (what was dropped stays lost).
        proxy.set_mode("pass")
        s.settimeout(5)
        assert roundtrip(s, b"after") == b"after"


def test_blackhole_hides_the_server_closing(proxy: FaultProxy, echo: EchoServer) -> None:
    with connect(proxy) as s:
        assert roundtrip(s, b"x") == b"x"
        proxy.set_mode("blackhole")
        for conn in echo.conns:
            conn.shutdown(socket.SHUT_RDWR)
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(100)
        assert proxy.stats()["connections_open"] == 1


def test_blackhole_passes_the_clients_close_unless_told_not_to(proxy: FaultProxy, echo: EchoServer) -> None:
    with connect(proxy) as s:
        assert roundtrip(s, b"a") == b"a"
        proxy.set_mode("blackhole")
    wait_for(lambda: echo.eofs == 1, what="the client's close to reach the server")

    proxy.set_mode("pass")
    s = connect(proxy)
    assert roundtrip(s, b"b") == b"b"
    proxy.set_mode("blackhole", forward_close=False)
    s.sendall(b"last-words")
    wait_for(lambda: echo.got(b"last-words"), what="the request")
    s.close()
    time.sleep(0.2)
    assert echo.eofs == 1  # the second close is held back, as a partition would lose it
    assert proxy.stats()["connections_open"] == 1
    proxy.set_mode("pass")  # healed: the close is passed on
    wait_for(lambda: echo.eofs == 2, what="the held close to reach the server")
    wait_for(lambda: proxy.stats()["connections_open"] == 0, what="the connection to be closed")


def test_reset_aborts_open_and_new_connections(proxy: FaultProxy) -> None:
    with connect(proxy) as s:
        assert roundtrip(s, b"ok") == b"ok"
        proxy.set_mode("reset")
        with pytest.raises(ConnectionResetError):
            s.recv(100)
    with pytest.raises(ConnectionResetError), connect(proxy) as s:
        # The first call after the RST arrived raises: on loopback often connect() itself.
        s.sendall(b"x")
        s.recv(100)
    assert proxy.stats()["resets_sent"] == 2


def test_reset_after_request_lets_the_write_through(proxy: FaultProxy, echo: EchoServer) -> None:
    with connect(proxy) as s:
        assert roundtrip(s, b"first") == b"first"
        proxy.set_mode("reset", after_request=True)
        s.sendall(b"the-write")
        with pytest.raises(ConnectionResetError):
            s.recv(100)
        assert echo.got(b"the-write")
    assert proxy.stats()["resets_sent"] == 1


def test_refuse_then_pass_on_the_same_port(proxy: FaultProxy) -> None:
    port = proxy.port
    with connect(proxy) as open_conn:
        assert roundtrip(open_conn, b"a") == b"a"
        proxy.set_mode("refuse")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        assert proxy.stats()["listening"] is False
        assert roundtrip(open_conn, b"b") == b"b"  # open connections keep working
        proxy.set_mode("pass")
    assert proxy.port == port
    with connect(proxy) as s:
        assert roundtrip(s, b"back") == b"back"


def test_refuse_can_reset_open_connections(proxy: FaultProxy) -> None:
    with connect(proxy) as s:
        assert roundtrip(s, b"a") == b"a"
        proxy.set_mode("refuse", reset_open=True)
        with pytest.raises(ConnectionResetError):
            s.recv(10)


def test_delay_switch_releases_held_bytes(proxy: FaultProxy) -> None:
    with connect(proxy) as s:
        assert roundtrip(s, b"a") == b"a"
        proxy.set_mode("delay", seconds=30, direction="response")
        s.sendall(b"held")
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(100)
        proxy.set_mode("pass")  # the held chunk is due at once
        s.settimeout(5)
        assert s.recv(100) == b"held"


def test_control_file_switches_modes(echo: EchoServer, tmp_path: Path) -> None:
    control = tmp_path / "proxy.json"
    write_mode(control, "refuse")
    with FaultProxy(target=("127.0.0.1", echo.port), control_file=control) as proxy:
        assert proxy.stats()["mode"] == "refuse"  # applied by start(), before any connection
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        write_mode(control, "pass")
        wait_for(lambda: proxy.stats()["listening"], what="the proxy to listen again")
        with connect(proxy) as s:
            assert roundtrip(s, b"hi") == b"hi"
            write_mode(control, "blackhole")
            wait_for(lambda: proxy.stats()["mode"] == "blackhole")
            s.sendall(b"lost")
            s.settimeout(0.3)
            with pytest.raises(TimeoutError):
                s.recv(10)
        control.write_text("{not json")  # ignored; the mode stays
        write_mode(control, "delay", seconds=0.5, direction="request")
        wait_for(lambda: proxy.stats()["params"] == {"seconds": 0.5, "direction": "request"})
    assert json.loads(control.read_text())["mode"] == "delay"
    assert read_mode(control) == make_mode("delay", seconds=0.5, direction="request")


def test_bad_modes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        make_mode("partition")
    with pytest.raises(ValueError):
        make_mode("delay", seconds=-1)
    with pytest.raises(ValueError):
        make_mode("reset", after=True)
    with pytest.raises(ValueError):
        write_mode(tmp_path / "c.json", "blackhole", seconds=1)
    assert not (tmp_path / "c.json").exists()
    with pytest.raises(ValueError):
        FaultProxy(target=("127.0.0.1", 1), listen_host="0.0.0.0")


def test_stop_closes_everything(echo: EchoServer) -> None:
    proxy = FaultProxy(target=("127.0.0.1", echo.port)).start()
    s = connect(proxy)
    assert roundtrip(s, b"x") == b"x"
    proxy.set_mode("blackhole")
    proxy.stop()
    assert s.recv(10) == b""  # closed, not left hanging
    s.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    assert not any(t.name == f"fault-proxy-{proxy.port}" for t in threading.enumerate())
    proxy.stop()  # idempotent


def test_upstream_down_resets_the_client() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with FaultProxy(target=("127.0.0.1", port)) as proxy:
        # The reset may land while connect() itself is still returning, or on the first read.
        with pytest.raises(ConnectionResetError), connect(proxy) as s:
            s.recv(10)
        assert proxy.stats()["upstream_connect_failures"] == 1


def test_cli_with_control_file(echo: EchoServer, tmp_path: Path) -> None:
    control = tmp_path / "ctl.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "proofline_kit.faults.proxy", "--listen", "0", "--target", f"127.0.0.1:{echo.port}",
         "--control-file", str(control)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            assert roundtrip(s, b"cli") == b"cli"
            write_mode(control, "reset")
            with pytest.raises(ConnectionResetError):
                s.recv(10)  # blocks until the control file is polled and the RST arrives

        def refused() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            except ConnectionRefusedError:
                return True
            except ConnectionResetError:  # still in reset mode: even connect() can see the RST
                return False
            return False

        write_mode(control, "refuse")
        wait_for(refused, what="connections to be refused")
        write_mode(control, "pass")
        wait_for(lambda: not refused(), what="the proxy to accept again")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=5)
        assert proc.returncode == 0
        stats = json.loads(err.strip().splitlines()[-1])
        assert stats["resets_sent"] >= 1 and stats["port"] == port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
