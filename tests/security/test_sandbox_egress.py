"""Egress by allowlist (worker/sandbox_egress.py, worker/egress_relay.py): a sandboxed server reaches
the loopback destinations its servers file allows and nothing else, an attempt at anything else is
a recorded violation, and nothing the allowlist adds outlives the sandbox.

Real bubblewrap and strace, a real stdio MCP server (tests/security/hostile_server.py), real TCP
peers on loopback (both reachable from the host: the sandbox, not an empty port, makes the
difference); the last tests run behind a real Celery worker and read the ledger.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from ledger.states import Outcome
from proofline.settings import ROOT
from proofline_kit.processes import gone
from tests.conftest import Stack, wait_for
from tests.security import test_sandbox
from tests.security.test_sandbox import hostile_spec, open_sessions, publish_hostile, write_servers
from tests.security.test_sandbox_audit import run_tool, violations_of
from worker.mcp_client import sandbox_violations

world = test_sandbox.world

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("strace") is None,
                                reason="bubblewrap (bwrap) and strace are needed")


class Peer:
    """A TCP service on 127.0.0.1 that answers each line with ``<tag>:<line>`` and counts connections."""

    def __init__(self, tag: str) -> None:
        self.tag, self.accepted = tag, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                conn.settimeout(5)
                try:
                    line = conn.makefile("rb").readline()
                    conn.sendall(f"{self.tag}:".encode() + line)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def peers() -> Iterator[tuple[Peer, Peer]]:
    allowed, other = Peer("allowed"), Peer("other")
    try:
        yield allowed, other
    finally:
        allowed.close()
        other.close()


def egress_spec(tools: Path, allowed: Peer) -> dict[str, Any]:
    return hostile_spec(tools, network={"allow": [f"127.0.0.1:{allowed.port}"]})


def exchange(peer: Peer, message: str = "hello") -> dict[str, Any]:
    return {"host": "127.0.0.1", "port": peer.port, "message": message}


def relays() -> list[psutil.Process]:
    """This process's in-sandbox relays (a worker of another test's stack may run some too)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            argv = p.cmdline()
        except psutil.Error:
            continue  # ended while listed
        if argv[1:3] == ["-I", "-S"] and len(argv) > 3 and argv[3].endswith("egress_relay.py"):
            found.append(p)
    return found


def test_only_the_allowed_destination_is_reachable_and_the_rest_is_a_violation(
        world: dict[str, Any], peers: tuple[Peer, Peer]) -> None:
    allowed, other = peers
    m = open_sessions(world, hostile=egress_spec(world["tools"], allowed))
    server = world["servers"]["hostile"]
    before = sandbox_violations()
    try:
        reached = run_tool(m, server, "write", "exchange", exchange(allowed))
        assert m.take_audit() == []  # reaching an allowed destination is no violation
        refused = run_tool(m, server, "write", "exchange", exchange(other))
        probe = run_tool(m, server, "write", "attempt", {"reads": [], "writes": [], "tcp": [5432, 6379], "unix": [],
                                                         "privileged": False})
        found = m.take_audit()
        forwarder = m._sessions[("hostile", "write")].egress  # noqa: SLF001
        assert forwarder is not None and forwarder.connections == 1
        folder = forwarder.directory
    finally:
        m.close()
    # The allowed peer answered through the relay and the forwarder: the server's client code
    # connected to 127.0.0.1:<port> as it would without a sandbox.
    assert reached == {"ok": True, "reply": "allowed:hello"}
    # The other peer listens on the host's loopback too, and was never reached.
    assert not refused["ok"] and "Connection refused" in refused["error"] and other.accepted == 0
    assert not probe["tcp"]["5432"]["ok"] and not probe["tcp"]["6379"]["ok"]
    assert {(f["kind"], f["address"]) for f in found} == {
        ("network_denied", f"127.0.0.1:{other.port}"), ("network_denied", "127.0.0.1:5432"),
        ("network_denied", "127.0.0.1:6379")}, json.dumps(found, indent=1)
    assert all(f["syscall"] == "connect" and f["in_flight"] and f["server"] == "hostile" for f in found)
    assert sandbox_violations() == before + 3
    # Closing the session ends the sandbox, its relay and the forwarder's folder of sockets.
    assert not os.path.exists(folder)
    wait_for(lambda: not relays(), 30, what="the relay to end with its session")
    assert not [t for t in threading.enumerate() if t.name == "egress-hostile-write"]  # the forwarder's, joined


def test_the_relay_dies_with_the_server(world: dict[str, Any], peers: tuple[Peer, Peer]) -> None:
    """The relay is the server's child, armed with PR_SET_PDEATHSIG: the server's death ends it (and
    the sandbox's PID namespace with it), and the next call gets a new sandbox that reaches again."""
    allowed, _ = peers
    m = open_sessions(world, hostile=egress_spec(world["tools"], allowed))
    server = world["servers"]["hostile"]
    try:
        assert run_tool(m, server, "write", "exchange", exchange(allowed))["ok"]
        mine = relays()
        assert len(mine) == 1
        relay = mine[0]
        host_server = relay.parent()
        assert host_server is not None and "hostile_server.py" in host_server.cmdline()[-1]
        host_server.kill()
        wait_for(lambda: gone(relay), 30, what="the relay to die with its server")
        m.discard(server, "write")
        assert run_tool(m, server, "write", "exchange", exchange(allowed, "again"))["reply"] == "allowed:again"
        assert len(relays()) == 1 and relays()[0].pid != relay.pid
    finally:
        m.close()


def test_a_server_that_kills_its_relay_reaches_nothing_new(world: dict[str, Any], peers: tuple[Peer, Peer]) -> None:
    """The relay is inside, the server's to kill: what bounds egress is the forwarder outside, which
    connects each bound socket to its one destination. Without the relay, nothing answers at all."""
    allowed, other = peers
    m = open_sessions(world, hostile=egress_spec(world["tools"], allowed))
    server = world["servers"]["hostile"]
    try:
        relay = relays()[0] if relays() else None
        assert relay is None  # no session yet
        assert run_tool(m, server, "write", "exchange", exchange(allowed))["ok"]
        relay = relays()[0]
        relay.kill()
        wait_for(lambda: gone(relay), 30, what="the relay to end")
        after = run_tool(m, server, "write", "exchange", exchange(allowed))
    finally:
        m.close()
    assert not after["ok"] and other.accepted == 0
    assert allowed.accepted == 1


def loopback_name() -> str | None:
    """A name of this machine that its resolver maps to a loopback address (often its host name)."""
    name = socket.gethostname()
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)}
    except OSError:
        return None
    return name if addresses and all(a.startswith("127.") for a in addresses) else None


@pytest.mark.skipif(loopback_name() is None, reason="this host's name does not resolve to loopback")
def test_a_named_host_is_reached_by_its_name_through_the_sandboxs_own_hosts_file(
        world: dict[str, Any], peers: tuple[Peer, Peer]) -> None:
    """The name resolves inside to the sandbox's own address for it (127.100.0.1), and outside, by
    the worker's resolver, to the peer (tests only reach loopback, so the name is one of this host's)."""
    allowed, _ = peers
    name = loopback_name()
    m = open_sessions(world, hostile=hostile_spec(world["tools"], network={"allow": [f"{name}:{allowed.port}"]}))
    server = world["servers"]["hostile"]
    try:
        by_name = run_tool(m, server, "write", "exchange", {"host": name, "port": allowed.port, "message": "named"})
        assert m.take_audit() == []
        inside = run_tool(m, server, "write", "peek", {"path": "/etc/hosts"})
        by_address = run_tool(m, server, "write", "exchange", exchange(allowed))  # the name was allowed, not this
        found = m.take_audit()
    finally:
        m.close()
    assert by_name == {"ok": True, "reply": "allowed:named"}
    assert f"127.100.0.1 {name}" in inside["data"].splitlines()
    assert not by_address["ok"] and allowed.accepted == 1
    assert {(f["kind"], f["address"]) for f in found} == {("network_denied", f"127.0.0.1:{allowed.port}")}


def test_a_worker_refuses_to_start_with_a_malformed_allowlist(world: dict[str, Any]) -> None:
    """The worker's start check reads the servers file as doctor does: a bad entry stops it, named."""
    path = write_servers(world["base"], {"api": hostile_spec(world["tools"], network={"allow": ["127.0.0.1:8443",
                                                                                               "db.internal:99999"]})})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")}
    env.update({"PROOFLINE_SERVERS_FILE": str(path),
                "PROOFLINE_BROKER_URL": "redis://127.0.0.1:1/0"})  # nothing listens: it must never consume
    proc = subprocess.run([sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "--pool", "solo",
                           "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", "egress@%h"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=90)
    out = proc.stderr + proc.stdout
    assert proc.returncode != 0 and "refuses to start" in out, out[-2000:]
    assert str(path) in out and "server api" in out and "'db.internal:99999'" in out and "1 to 65535" in out


# --- through a real worker -------------------------------------------------------------------------

#: An exchange whose verification read (the read identity, which inherits the allowlist) repeats
#: it: verified only when the peer answered both.
EXCHANGE_CONTRACT = test_sandbox.CONTRACT.format(action="hostile.exchange", server="hostile", tool="exchange").replace(
    'read: {tool: status, arguments: {}}\n  expected: ["after.found"]',
    'read: {tool: exchange, arguments: {host: "args.host", port: "args.port", message: "args.message"}}\n'
    '  expected: ["after.ok"]')


@pytest.fixture(scope="module")
def egress_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Peer, Peer]]:
    assert "tool: exchange" in EXCHANGE_CONTRACT
    allowed, other = Peer("allowed"), Peer("other")
    try:
        for s in test_sandbox.start_hostile_stack(tmp_path_factory.mktemp("egress-stack"), [],
                                                  lambda tools: {"hostile": egress_spec(tools, allowed)},
                                                  {"hostile.exchange": EXCHANGE_CONTRACT}):
            yield s, allowed, other
    finally:
        allowed.close()
        other.close()


def test_through_a_real_worker_an_allowed_destination_is_reached_and_verified(
        egress_stack: tuple[Stack, Peer, Peer]) -> None:
    s, allowed, _ = egress_stack
    aid = publish_hostile(s, "exchange", exchange(allowed, "ticket-1"))
    row = s.wait_settled(aid)
    assert row.outcome == Outcome.completed_verified, s.events(aid)
    assert s.action(aid).result["values"] == {"ok": True, "reply": "allowed:ticket-1"}
    finished = next(e for e in s.timeline(aid) if e["event"] == "verification_finished")["evidence"]
    assert finished["after"] == {"ok": True, "reply": "allowed:ticket-1"}
    assert violations_of(s, aid) == []
    assert allowed.accepted >= 2  # the call and its verification read, each through its own sandbox


def test_through_a_real_worker_a_destination_not_allowed_is_a_violation(
        egress_stack: tuple[Stack, Peer, Peer]) -> None:
    s, _, other = egress_stack
    aid = publish_hostile(s, "exchange", exchange(other, "ticket-2"))
    row = s.wait_settled(aid)
    wait_for(lambda: violations_of(s, aid), 30, what="the violation events")
    found = violations_of(s, aid)
    assert other.accepted == 0
    assert {(f["kind"], f["address"]) for f in found} == {("network_denied", f"127.0.0.1:{other.port}")}
    assert {f["role"] for f in found} == {"write", "read"}  # the call, then its verification read
    # Classified: the call returned (the server's own error inside its result), and the
    # verification read, refused the same way, did not find what the contract expects.
    assert s.action(aid).result["values"]["ok"] is False
    assert row.outcome == Outcome.completed_unverified, s.events(aid)
    finished = next(e for e in s.timeline(aid) if e["event"] == "verification_finished")["evidence"]
    assert finished["finding"] != "expected" and finished["after"]["ok"] is False
    names = [e["event"] for e in s.timeline(aid)]
    assert names.index("tool_called") < names.index("sandbox_violation")
    assert str(ROOT) not in json.dumps(found)
