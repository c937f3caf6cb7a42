"""The session host's relay rules, against a real host process and a real stdio server process
that records every line it receives: a later borrower's ``initialize`` answered from the first
answer; a departed borrower's request cancelled for it, and its late answer never delivered to the
next borrower, even under the same id; server requests while nobody borrows answered by the host."""

from __future__ import annotations

import json
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from proofline_kit.processes import wait_for
from worker import host_process
from worker.session_host import ID_SPAN, NO_BORROWER

SERVER = textwrap.dedent("""
    import json, sys, threading, time
    log = open(sys.argv[1], "a", buffering=1)
    out_lock = threading.Lock()
    def send(message):
        with out_lock:
            sys.stdout.write(json.dumps(message) + "\\n"); sys.stdout.flush()
    def slow(ident, seconds):
        time.sleep(seconds); send({"jsonrpc": "2.0", "id": ident, "result": {"slept": seconds, "for": ident}})
    for line in sys.stdin:
        log.write(line)
        message = json.loads(line)
        method = message.get("method")
        if method == "initialize":
            send({"jsonrpc": "2.0", "id": message["id"], "result": {"protocolVersion": "2025-06-18",
                  "capabilities": {}, "serverInfo": {"name": "scripted", "version": "1"}}})
        elif method == "slow":
            threading.Thread(target=slow, args=(message["id"], message["params"]["seconds"])).start()
        elif method == "ask":
            send({"jsonrpc": "2.0", "id": "s-1", "method": "roots/list"})
            send({"jsonrpc": "2.0", "id": message["id"], "result": {}})
""")


class Borrower:
    """A pool process's two connections, spoken by hand."""

    def __init__(self, path: str, spec: dict) -> None:
        self.control = socket.socket(socket.AF_UNIX)
        self.control.settimeout(20)
        self.control.connect(path)
        self.control_file = self.control.makefile("rb")
        self.loan = self.ask("checkout", spec=spec)
        self.data = socket.socket(socket.AF_UNIX)
        self.data.settimeout(20)
        self.data.connect(path)
        self.data.sendall(json.dumps({"attach": self.loan["lease"]}).encode() + b"\n")
        self.data_file = self.data.makefile("rb")

    def ask(self, op: str, **fields) -> dict:
        self.control.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
        return json.loads(self.control_file.readline())

    def send(self, message: dict) -> None:
        self.data.sendall(json.dumps(message).encode() + b"\n")

    def receive(self, timeout: float = 20) -> dict:
        self.data.settimeout(timeout)
        return json.loads(self.data_file.readline())

    def vanish(self) -> None:
        """As a killed process does: both sockets close, nothing said."""
        for f in (self.data_file, self.control_file, self.data, self.control):
            f.close()  # a socket's file objects hold it open until they close too


@pytest.fixture()
def host(tmp_path: Path):
    path = host_process.start(spares=0)
    assert path is not None
    try:
        yield path
    finally:
        host_process.stop()


def spec(tmp_path: Path) -> dict:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    return {"server": "scripted", "role": "write", "base_dir": str(tmp_path), "environment": "development",
            "max_message_bytes": 1 << 20,
            "endpoint": {"transport": "stdio", "command": [sys.executable, str(script), str(tmp_path / "seen.jsonl")],
                         "sandbox": {"enabled": False, "reason": "a scripted test server"}}}


def seen(tmp_path: Path) -> list[dict]:
    path = tmp_path / "seen.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_later_borrower_is_answered_from_the_first_initialize_and_never_gets_an_earlier_answer(
        host: str, tmp_path: Path) -> None:
    first = Borrower(host, spec(tmp_path))
    assert first.loan["ok"] and first.loan["id_base"] == 0
    first.send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18"}})
    assert first.receive()["result"]["serverInfo"]["name"] == "scripted"
    first.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
    first.send({"jsonrpc": "2.0", "id": 7, "method": "slow", "params": {"seconds": 4}})
    wait_for(lambda: any(m.get("id") == 7 for m in seen(tmp_path)), 20, what="the slow request to reach the server")
    first.vanish()
    # The host cancelled the departed borrower's request on its behalf.
    wait_for(lambda: any(m.get("method") == "notifications/cancelled" and m["params"]["requestId"] == 7
                         for m in seen(tmp_path)), 20, what="the host to cancel request 7")

    second = Borrower(host, spec(tmp_path))
    assert second.loan["pid"] == first.loan["pid"], "the same server process is lent again"
    assert second.loan["id_base"] >= ID_SPAN
    second.send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18"}})
    answer = second.receive()
    assert answer["id"] == 1 and answer["result"]["serverInfo"]["name"] == "scripted"
    second.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
    # An id an earlier borrower could have used is refused by the host, unsent.
    second.send({"jsonrpc": "2.0", "id": 7, "method": "slow", "params": {"seconds": 1}})
    refused = second.receive()
    assert refused["id"] == 7 and refused["error"]["code"] == -32600
    # Its own request, in flight while the departed borrower's late answer comes back, gets its
    # own answer: the late one is dropped, not delivered.
    mine = second.loan["id_base"] + 7
    second.send({"jsonrpc": "2.0", "id": mine, "method": "slow", "params": {"seconds": 6}})
    answer = second.receive(timeout=30)
    assert answer["id"] == mine and answer["result"]["slept"] == 6
    assert any(m.get("id") == 7 for m in seen(tmp_path))
    server_saw = seen(tmp_path)
    assert [m["method"] for m in server_saw if m.get("method") == "initialize"] == ["initialize"]
    assert len([m for m in server_saw if m.get("method") == "notifications/initialized"]) == 1
    assert [m["params"]["seconds"] for m in server_saw if m.get("method") == "slow"] == [4, 6]
    second.ask("release")


def test_a_server_request_while_nobody_borrows_is_answered_by_the_host(host: str, tmp_path: Path) -> None:
    borrower = Borrower(host, spec(tmp_path))
    borrower.send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18"}})
    borrower.receive()
    borrower.send({"jsonrpc": "2.0", "id": 2, "method": "ask"})
    request = borrower.receive()
    assert request["method"] == "roots/list"  # a borrower is attached: the request is its own to answer
    assert borrower.receive()["id"] == 2
    borrower.vanish()
    # Its unanswered request was answered by the host with an error, so the server does not wait.
    wait_for(lambda: any(m.get("id") == "s-1" and m.get("error", {}).get("code") == NO_BORROWER
                         for m in seen(tmp_path)), 20, what="the host to answer the server's request")
