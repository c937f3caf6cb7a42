"""Denied-path auditing of sandboxed stdio servers (worker/sandbox_audit.py): every escape a hostile
server attempts is a recorded violation, a well-behaved server produces none, the audit channel is
out of the server's reach, and production refuses to drop the audit silently.

Real bubblewrap and strace, real MCP sessions; the last tests run behind a real Celery worker and
read the violations back from the ledger.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from proofline.errors import ConfigurationError
from proofline_kit.processes import gone
from tests.conftest import Stack, wait_for
from tests.security import test_sandbox
from tests.security.test_sandbox import (
    KEY_CANARY,
    hostile_spec,
    open_sessions,
    publish_hostile,
    write_servers,
)
from worker.mcp_client import McpSessions, sandbox_violations
from worker.sandbox import SandboxSpec, require_audit
from worker.servers import check_sandbox_policy, load_servers

#: The fixture of test_sandbox.py: a worker folder with a key file, the server's tools and data.
world = test_sandbox.world
PG_SOCKET = "/var/run/postgresql/.s.PGSQL.5432"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("strace") is None,
                                reason="bubblewrap (bwrap) and strace are needed")


def data_spec(world: dict[str, Any]) -> dict[str, Any]:
    """The hostile server with a read-only data folder next to its writable one."""
    data = world["base"] / "data"
    data.mkdir(exist_ok=True)
    (data / "records.txt").write_text("original")
    spec = hostile_spec(world["tools"])
    spec["sandbox"]["ro_paths"].append(str(data))
    return spec


def escapes(world: dict[str, Any]) -> dict[str, Any]:
    return {"reads": ["/etc/shadow", str(world["keys"] / "controller.key"), f"/proc/{world['holder']}/environ"],
            "writes": [str(world["base"] / "data" / "records.txt")], "tcp": [5432], "unix": [PG_SOCKET],
            "privileged": True}


def run_tool(m: McpSessions, server: Any, role: str, tool: str, args: dict[str, Any]) -> Any:
    async def go(client):  # noqa: ANN001
        return await client.call_tool(tool, args, read_timeout_seconds=60)

    result = m.run(server, role, go)
    assert not result.is_error, result.content
    return result.structured_content


def by_kind(found: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(f["kind"], f.get("path") or f.get("address") or f["syscall"]) for f in found}


def test_each_escape_attempt_is_a_recorded_violation(world: dict[str, Any]) -> None:
    # The targets exist where the worker runs: the sandbox hides them, it does not merely lack them.
    assert Path("/etc/shadow").exists() and (world["keys"] / "controller.key").exists()
    assert Path(f"/proc/{world['holder']}/environ").exists()
    m = open_sessions(world, hostile=data_spec(world))
    server = world["servers"]["hostile"]
    try:
        assert run_tool(m, server, "write", "status", {})["found"]
        assert m.take_audit() == []  # start-up and a harmless call: nothing
        before = sandbox_violations()
        got = run_tool(m, server, "write", "attempt", escapes(world))
        found = m.take_audit()
    finally:
        m.close()
    # Contained: the server got an error for every attempt, and nothing changed.
    assert not any(r["ok"] for r in got["reads"].values()) and not got["writes"][escapes(world)["writes"][0]]["ok"]
    assert not got["tcp"]["5432"]["ok"] and not got["unix"][PG_SOCKET]["ok"]
    assert got["ptrace"][0] == -1 and got["mount"][0] == -1
    assert (world["base"] / "data" / "records.txt").read_text() == "original"
    # Recorded: one violation per attempt, with the path (or address), syscall and errno.
    assert by_kind(found) == {
        ("hidden_path", "/etc/shadow"), ("hidden_path", str(world["keys"] / "controller.key")),
        ("hidden_path", f"/proc/{world['holder']}/environ"), ("read_only", escapes(world)["writes"][0]),
        ("network_denied", "127.0.0.1:5432"), ("hidden_path", PG_SOCKET),
        ("denied_syscall", "ptrace"), ("denied_syscall", "/tmp"),
    }, json.dumps(found, indent=1)
    write = next(f for f in found if f["kind"] == "read_only")
    assert write["errno"] == "EROFS" and write["syscall"] in ("open", "openat")
    shadow = next(f for f in found if f.get("path") == "/etc/shadow")
    assert shadow["errno"] == "ENOENT" and shadow["server"] == "hostile" and shadow["role"] == "write"
    assert all(f["in_flight"] for f in found)
    assert sandbox_violations() == before + len(found)


def test_a_well_behaved_server_produces_no_violations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The repo's own sor server, both identities, over a normal run of reads and writes."""
    server, _ = test_sandbox.repo_sor(tmp_path, monkeypatch)
    m = McpSessions(tmp_path)
    before = sandbox_violations()
    try:
        for i in range(3):
            created = run_tool(m, server, "write", "create_ticket", {"tenant": "acme", "title": f"t{i}",
                                                                     "owner": "alice"})
            assert run_tool(m, server, "read", "get_ticket", {"ticket_id": created["ticket_id"]})["found"]
            run_tool(m, server, "write", "get_service", {"service": "checkout"})
            run_tool(m, server, "read", "find_ticket_by_key", {"idempotency_key": f"absent-{i}"})
        audited = {role: m._sessions[("sor", role)].auditor for role in ("write", "read")}  # noqa: SLF001
        found = m.take_audit()
    finally:
        m.close()
        load_servers.cache_clear()
    # Positive control: both sessions were audited (the marker was seen), and found nothing.
    assert all(a is not None and a.armed for a in audited.values())
    assert found == [], json.dumps(found, indent=1)
    assert sandbox_violations() == before


def test_the_server_cannot_reach_the_audit_channel(world: dict[str, Any]) -> None:
    m = open_sessions(world, hostile=data_spec(world))
    server = world["servers"]["hostile"]
    try:
        auditor = m._session(server, "write").auditor  # noqa: SLF001
        assert auditor is not None and auditor.armed
        fifo = auditor.path
        got = run_tool(m, server, "write", "probe", {"worker_pids": [], "files": [fifo], "dirs": [auditor.directory]})
        fds = run_tool(m, server, "write", "open_files", {})
        found = m.take_audit()
    finally:
        m.close()
    # The FIFO strace writes to is not in the sandbox, and no process there holds it open.
    assert not got["files"][0]["ok"] and not got["dirs"][auditor.directory]["ok"]
    assert fds and all(fifo not in target and "proofline-audit" not in target for target in fds.values()), fds
    assert not any("/strace/" in key for key in fds)  # the tracer is not a process of the sandbox
    # Trying to reach it is itself recorded.
    assert {("hidden_path", fifo), ("hidden_path", auditor.directory)} <= by_kind(found)


def test_audit_policy_production_refuses_to_drop_it_silently(world: dict[str, Any]) -> None:
    spec = SandboxSpec()
    assert require_audit("s", "write", spec, "production", available=True) is None
    with pytest.raises(ConfigurationError, match="strace is not installed"):
        require_audit("s", "write", spec, "production", available=False)
    assert "strace" in (require_audit("s", "write", spec, "development", available=False) or "")
    with pytest.raises(ConfigurationError, match="sandbox.audit"):
        require_audit("s", "write", SandboxSpec(audit=True), "development", available=False)
    off = SandboxSpec(audit=False)
    with pytest.raises(ConfigurationError, match="audit: false"):
        require_audit("s", "write", off, "production", available=True)
    reason = "vendor binary traces itself; reviewed by security"
    assert require_audit("s", "write", SandboxSpec(audit=False, audit_reason=reason), "production",
                         available=True) == reason
    # The worker's start-up check covers it, and a session is refused before anything is spawned.
    unaudited = hostile_spec(world["tools"], audit=False)
    path = write_servers(world["base"], {"quiet": unaudited})
    with pytest.raises(ConfigurationError, match="'quiet'"):
        check_sandbox_policy(path, "production")
    m = open_sessions(world, "production", quiet=unaudited)
    try:
        with pytest.raises(ConfigurationError, match="'quiet'"):
            run_tool(m, world["servers"]["quiet"], "write", "status", {})
    finally:
        m.close()
    # With a reason it runs unaudited, and says so.
    explained = hostile_spec(world["tools"], audit=False, audit_reason=reason)
    path = write_servers(world["base"], {"quiet": explained})
    assert check_sandbox_policy(path, "production") == {"quiet/write": f"sandboxed, not audited: {reason}",
                                                        "quiet/read": f"sandboxed, not audited: {reason}"}
    m = open_sessions(world, "production", quiet=explained)
    try:
        assert run_tool(m, world["servers"]["quiet"], "write", "attempt", escapes(world))["reads"]
        assert m._sessions[("quiet", "write")].auditor is None  # noqa: SLF001
        assert m.take_audit() == []
    finally:
        m.close()


# --- through a real worker -------------------------------------------------------------------------


def audited_servers(tools: Path) -> dict[str, Any]:
    data = tools.parent / "data"
    data.mkdir()
    (data / "records.txt").write_text("original")
    spec = hostile_spec(tools)
    spec["sandbox"]["ro_paths"].append(str(data))
    return {"hostile": spec}


#: A harmless call whose verification read (the read identity) tries to read /etc/shadow.
PRYING_VERIFIER = test_sandbox.CONTRACT.format(action="hostile.pry", server="hostile", tool="note").replace(
    'read: {tool: status, arguments: {}}\n  expected', 'read: {tool: peek, arguments: {path: "args.path"}}\n  expected')


@pytest.fixture(scope="module")
def audit_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    assert "tool: peek" in PRYING_VERIFIER
    yield from test_sandbox.start_hostile_stack(tmp_path_factory.mktemp("audit-stack"),
                                                [("hostile.attempt", "hostile", "attempt")], audited_servers,
                                                {"hostile.pry": PRYING_VERIFIER})


def violations_of(s: Stack, aid: str) -> list[dict[str, Any]]:
    return [e["evidence"] for e in s.timeline(aid) if e["event"] == "sandbox_violation"]


def test_through_a_real_worker_each_attempt_is_a_violation_event(audit_stack: Stack) -> None:
    s = audit_stack
    holder = subprocess.Popen(["sleep", "120"])
    try:
        # Control first: the same contract and server, no attempts. No violation at all (the
        # server's start-up included), and its outcome is what the attempt's must equal.
        quiet = publish_hostile(s, "attempt", {"reads": [], "writes": [], "tcp": [], "unix": [], "privileged": False})
        s.wait_event(quiet, "tool_called", timeout=90)
        attempts = {"reads": ["/etc/shadow", str(s.workdir / "keys" / "controller.key"), f"/proc/{holder.pid}/environ"],
                    "writes": [str(s.workdir / "data" / "records.txt")], "tcp": [5432], "unix": [PG_SOCKET],
                    "privileged": True}
        aid = publish_hostile(s, "attempt", attempts)
        s.wait_event(aid, "tool_called", timeout=90)
        wait_for(lambda: len(violations_of(s, aid)) >= 8, 30, what="the violation events")
    finally:
        holder.kill()
        holder.wait()
    found = violations_of(s, aid)
    assert violations_of(s, quiet) == []
    assert by_kind(found) == {
        ("hidden_path", "/etc/shadow"), ("hidden_path", str(s.workdir / "keys" / "controller.key")),
        ("hidden_path", f"/proc/{holder.pid}/environ"), ("read_only", attempts["writes"][0]),
        ("network_denied", "127.0.0.1:5432"), ("hidden_path", PG_SOCKET),
        ("denied_syscall", "ptrace"), ("denied_syscall", "/tmp"),
    }, json.dumps(found, indent=1)
    assert all(f["server"] == "hostile" and f["in_flight"] and "action_id" not in f for f in found)
    # The violations sit next to the call they happened in, on this action's chain only.
    timeline = s.timeline(aid)
    names = [e["event"] for e in timeline]
    assert names.index("tool_called") < names.index("sandbox_violation")
    # The policy: evidence, not a verdict. The call's outcome is what it would have been.
    outcome = next(e for e in timeline if e["event"] == "tool_called")["evidence"]["outcome"]
    control = next(e for e in s.timeline(quiet) if e["event"] == "tool_called")["evidence"]["outcome"]
    assert outcome == control
    assert (s.workdir / "data" / "records.txt").read_text() == "original"
    assert KEY_CANARY not in json.dumps(found)


def test_the_tracers_death_takes_the_server_with_it(world: dict[str, Any]) -> None:
    """Fail closed: a server never runs on untraced. Killing strace (as nothing inside the sandbox
    can, it is not in its PID namespace) ends the server; the next call gets a fresh, audited one."""
    m = open_sessions(world, hostile=data_spec(world))
    server = world["servers"]["hostile"]
    me = psutil.Process()

    def traced() -> tuple[list[psutil.Process], list[psutil.Process]]:
        # This process's own sessions only (a worker of another test's stack may run here too).
        tracers = [p for p in me.children() if p.name() == "strace"]
        kids = [k for t in tracers for k in t.children(recursive=True)]
        servers = [p for p in kids if p.name().startswith("python") and "hostile_server.py" in p.cmdline()[-1]]
        return tracers, servers

    try:
        first = run_tool(m, server, "write", "status", {})["pid"]
        tracers, servers = traced()
        assert len(tracers) == 1 and len(servers) == 1
        tracers[0].kill()
        wait_for(lambda: gone(servers[0]), 30,
                 what="the server to die with its tracer")
        with pytest.raises(Exception):  # noqa: B017 - the SDK's error for a closed connection
            run_tool(m, server, "write", "status", {})
        m.discard(server, "write")
        assert run_tool(m, server, "write", "attempt", {**escapes(world), "privileged": False})["reads"]
        again, _ = traced()
        assert len(again) == 1 and again[0].pid != tracers[0].pid
        assert {f["path"] for f in m.take_audit() if f["kind"] == "hidden_path"} >= {"/etc/shadow"}
        assert first == 2  # the server is PID 2 of its own namespace (bwrap is 1)
    finally:
        m.close()


def test_through_a_real_worker_a_verification_reads_violations_are_the_actions(audit_stack: Stack) -> None:
    """Found during verification (recovery/verify.py), by the read identity: on the same action."""
    s = audit_stack
    aid = publish_hostile(s, "pry", {"path": "/etc/shadow"})
    s.wait_event(aid, "verification_finished", timeout=90)
    wait_for(lambda: violations_of(s, aid), 30, what="the verification's violations")
    found = violations_of(s, aid)
    assert {(f["kind"], f["path"], f["role"]) for f in found} == {("hidden_path", "/etc/shadow", "read")}
    names = [e["event"] for e in s.timeline(aid)]
    # Recorded after the verification read that made them; the write call made none.
    assert names.index("sandbox_violation") > names.index("tool_called")
