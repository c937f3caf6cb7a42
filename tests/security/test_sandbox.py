"""Sandboxed stdio tool servers, attacked by a hostile server (tests/security/hostile_server.py).

Real bubblewrap, real MCP sessions, real SQLite; the last tests run the hostile server behind a
real Celery worker and read what reached the ledger. The process running McpSessions plays the
worker: it holds a canary credential in its environment and a key file on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from proofline.errors import ConfigurationError
from proofline.settings import ROOT
from proofline_kit.sor import store as sor
from tests.conftest import CANARY_SECRET, Stack, build_stack, start_workers, teardown_stack, wait_for
from worker.mcp_client import McpSessions, sandbox_violations
from worker.sandbox import interpreter_paths
from worker.servers import check_sandbox_policy, load_servers

HOSTILE = Path(__file__).with_name("hostile_server.py")
KEY_CANARY = "canary-private-key-material"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def write_servers(base: Path, servers: dict[str, Any]) -> Path:
    path = base / f"servers-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump({"servers": servers}))
    load_servers.cache_clear()
    return path


def hostile_spec(tools: Path, **sandbox: Any) -> dict[str, Any]:
    return {
        "transport": "stdio", "command": ["{python}", str(tools / "hostile_server.py")], "cwd": "var",
        "env": {"HOSTILE_MARK": "explicit-env-only"},
        "sandbox": {"ro_paths": [str(tools)], "rw_paths": ["var"], **sandbox},
        "read_identity": {"sandbox": {"uid": 65533}},
    }


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A 'worker' directory: a key file, the hostile server's own folder, its data folder."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CANARY_SECRET)
    monkeypatch.setenv("PROOFLINE_DATABASE_URL", f"postgresql://proofline_worker:{CANARY_SECRET}@127.0.0.1/x")
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "controller.key").write_text(json.dumps({"key_id": "k", "private_key": KEY_CANARY}))
    (keys / "controller.key").chmod(0o600)
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy(HOSTILE, tools / "hostile_server.py")
    (tmp_path / "var").mkdir()
    db = tmp_path / "var" / "data.sqlite3"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (x TEXT)")
    # A process holding the canary since its exec (what /proc/<pid>/environ shows): this test
    # process only got it from monkeypatch, after its own exec.
    holder = subprocess.Popen(["sleep", "300"], env={"AWS_SECRET_ACCESS_KEY": CANARY_SECRET})
    try:
        yield {"base": tmp_path, "keys": keys, "tools": tools, "db": db, "holder": holder.pid}
    finally:
        holder.kill()
        holder.wait()
        load_servers.cache_clear()


def open_sessions(world: dict[str, Any], environment: str = "development", **servers: dict) -> McpSessions:
    path = write_servers(world["base"], servers)
    world["servers"], world["servers_file"] = load_servers(path), path
    return McpSessions(world["base"], environment)


def call(m: McpSessions, world: dict, role: str, tool: str, args: dict[str, Any], name: str = "hostile") -> Any:
    async def go(client):  # noqa: ANN001
        return await client.call_tool(tool, args, read_timeout_seconds=60)

    result = m.run(world["servers"][name], role, go)  # type: ignore[arg-type]
    assert not result.is_error, result.content
    return result.structured_content


def loot(m: McpSessions, world: dict, role: str = "write") -> dict[str, Any]:
    return call(m, world, role, "probe", {
        "worker_pids": [os.getpid(), os.getppid(), world["holder"]],
        "files": [str(ROOT / "servers.yaml"), str(world["keys"] / "controller.key"), str(world["servers_file"]),
                  "/etc/shadow", "/etc/passwd", "/root/.bash_history", str(Path.home() / ".pgpass")],
        "dirs": ["/root", "/etc", str(world["keys"]), str(ROOT), "/home", "/var/run/postgresql"],
    })


def test_a_hostile_server_gets_nothing_of_the_worker(world: dict[str, Any]) -> None:
    m = open_sessions(world, hostile=hostile_spec(world["tools"]))
    try:
        got = loot(m, world)
    finally:
        m.close()
    text = json.dumps(got)
    # Positive control: the probe ran, inside the sandbox, as the configured uid.
    assert got["uid"] == 65534 and got["gid"] == 65534 and got["hostname"] == "sandbox"
    assert got["environs"]["self"]["HOSTILE_MARK"] == "explicit-env-only"
    # No credential of the worker's anywhere in what it could read.
    assert CANARY_SECRET not in text and KEY_CANARY not in text
    assert "AWS_SECRET_ACCESS_KEY" not in got["environs"]["self"]
    assert "PROOFLINE_DATABASE_URL" not in text
    # Its own PID namespace: the worker's processes do not exist there.
    assert os.getpid() not in got["visible_pids"] and world["holder"] not in got["visible_pids"]
    assert got["ppid"] in (0, 1)
    for pid in (os.getpid(), os.getppid(), world["holder"]):
        assert not got["maps"][str(pid)]["ok"] and not got["environs"][f"worker:{pid}:environ"]["ok"]
    # PID 1 is bwrap, started with the launcher's minimal environment, never the worker's.
    pid1 = got["environs"]["pid1:environ"]
    assert pid1["ok"] and set(k.split("=", 1)[0] for k in pid1["data"].split("\0") if k) <= {
        "PATH", "LANG", "HOME", "LOGNAME", "USER", "SHELL", "TERM", "PWD"}
    # Files outside the declared paths do not exist for it (the first five exist on the host).
    assert all(Path(r["path"]).exists() for r in got["files"][:5])
    for result in got["files"]:
        f = result["path"]
        assert not result["ok"], f"{f} was readable: {result}"
    assert not got["dirs"][str(world["keys"])]["ok"]
    assert not got["dirs"]["/home"]["ok"] and not got["dirs"]["/var/run/postgresql"]["ok"]
    root_seen = set(got["dirs"]["/root"].get("entries", []))
    needed = {Path(p).relative_to("/root").parts[0] for p in interpreter_paths() if p.startswith("/root/")}
    assert root_seen <= needed, f"/root shows more than the interpreter needs: {root_seen - needed}"
    assert set(got["dirs"]["/etc"]["entries"]) <= {"ld.so.cache"}
    # The checkout shows only the project's own package folders (an editable install), no config.
    assert "servers.yaml" not in got["dirs"][str(ROOT)].get("entries", [])
    # No network: Postgres and Redis on loopback are unreachable, so are their sockets.
    for target, result in {**got["tcp"], **got["unix"]}.items():
        assert not result["ok"], f"{target} was reachable"
    assert "ConnectionRefused" in got["tcp"]["127.0.0.1:5432"]["error"]
    # The limits are set (hard) inside.
    assert got["limits"]["RLIMIT_AS"] == [1024 * 1024 * 1024] * 2
    assert got["limits"]["RLIMIT_NOFILE"] == [256, 256] and got["limits"]["RLIMIT_NPROC"] == [64, 64]


def test_the_read_identity_cannot_write_its_data(world: dict[str, Any]) -> None:
    m = open_sessions(world, hostile=hostile_spec(world["tools"]))
    db = str(world["db"])
    try:
        reader = call(m, world, "read", "write_database", {"path": db})
        reader_probe = loot(m, world, "read")
        writer = call(m, world, "write", "write_database", {"path": db})
    finally:
        m.close()
    assert reader_probe["uid"] == 65533
    assert not reader["sqlite"]["ok"] and "readonly" in reader["sqlite"]["error"]
    assert not reader["raw"]["ok"] and "Read-only file system" in reader["raw"]["error"]
    assert not reader["create"]["ok"]
    # Positive control: the writer, with the same folder bound writable, can.
    assert writer["sqlite"]["ok"] and writer["raw"]["ok"] and writer["create"]["ok"]
    with sqlite3.connect(world["db"]) as conn:
        assert conn.execute("SELECT count(*) FROM pwned").fetchone()[0] == 1  # the writer's row only


def repo_sor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Path]:
    """The repo's own servers.yaml and its sor server on a freshly seeded file under ``tmp_path``."""
    shutil.copy(ROOT / "servers.yaml", tmp_path / "servers.yaml")
    db = tmp_path / "var" / "sor.sqlite3"
    sor.init_db(db)
    sor.seed_demo(db)
    monkeypatch.setenv("SOR_DB", str(db))
    load_servers.cache_clear()
    return load_servers(tmp_path / "servers.yaml")["sor"], db


def test_the_repos_sor_reader_cannot_write_the_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The repo's own servers.yaml: the sor reader is the same program with var/ bound read-only."""
    server, db = repo_sor(tmp_path, monkeypatch)
    assert server.read.sandbox.rw_paths == () and server.read.sandbox.ro_paths == ("var",)
    assert server.read.sandbox.uid == 65533 and server.write.sandbox.rw_paths == ("var",)
    # Run the hostile program as the sor reader identity: same sandbox block, its own command.
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy(HOSTILE, tools / "hostile_server.py")
    spec = server.read.model_dump(mode="json", exclude_defaults=True)
    spec["command"] = ["{python}", str(tools / "hostile_server.py")]
    spec["sandbox"]["ro_paths"] = [*spec["sandbox"]["ro_paths"], str(tools)]
    path = write_servers(tmp_path, {"evil": {**spec, "read_identity": {}}})
    evil = load_servers(path)["evil"]
    m = McpSessions(tmp_path)
    before = sor.effects(db)
    try:
        async def go(client):  # noqa: ANN001
            return await client.call_tool("write_database", {"path": str(db)}, read_timeout_seconds=30)

        # The writer side of "evil" inherits nothing writable from a read identity either.
        got = m.run(evil, "write", go).structured_content
    finally:
        m.close()
        load_servers.cache_clear()
    assert not got["sqlite"]["ok"] and not got["raw"]["ok"] and not got["create"]["ok"]
    assert sor.effects(db) == before
    assert not (tmp_path / "var" / "dropped.txt").exists()


def test_limits_kill_a_cpu_spinner_and_cap_memory(world: dict[str, Any]) -> None:
    m = open_sessions(world, hostile=hostile_spec(world["tools"], cpu_seconds=4, memory_mb=512))
    server = world["servers"]["hostile"]
    before = sandbox_violations()
    try:
        # Memory: an allocation past the address-space limit fails inside; the server lives on.
        assert call(m, world, "write", "allocate", {"megabytes": 1024}) == {"ok": False, "error": "MemoryError"}
        assert call(m, world, "write", "allocate", {"megabytes": 16})["ok"]
        # CPU: a spinning tool is killed at the limit; the call fails and the death is evidence.
        with pytest.raises(Exception):  # noqa: B017 - the SDK's error for a closed connection
            call(m, world, "write", "spin", {"seconds": 120})
        violation = m.discard(server, "write")
        assert violation is not None, "the kill should be recognised as a sandbox violation"
        assert violation["signal_name"] in ("SIGKILL", "SIGXCPU") and violation["server"] == "hostile"
        assert sandbox_violations() == before + 1
        # A new session replaces it, and a normal close is not a violation.
        assert call(m, world, "write", "status", {})["found"]
        assert m.discard(server, "write") is None
        assert sandbox_violations() == before + 1
    finally:
        m.close()


def test_production_refuses_an_unsandboxed_server_without_a_reason(world: dict[str, Any]) -> None:
    spec = hostile_spec(world["tools"])
    spec["sandbox"] = {"enabled": False}
    spec["read_identity"] = {}
    m = open_sessions(world, "production", open=spec)
    try:
        with pytest.raises(ConfigurationError, match="'open'"):
            call(m, world, "write", "status", {}, name="open")
    finally:
        m.close()
    path = write_servers(world["base"], {"open": spec})
    with pytest.raises(ConfigurationError, match="'open'"):
        check_sandbox_policy(path, "production")
    assert check_sandbox_policy(path, "development") == {"open/write": "unsandboxed (development)",
                                                         "open/read": "unsandboxed (development)"}
    # With a reason it runs (unsandboxed: it sees the worker), and the reason is what gets recorded.
    spec["sandbox"] = {"enabled": False, "reason": "vendor binary needs /dev/kvm; reviewed 2026-11"}
    m = open_sessions(world, "production", open=spec)
    try:
        assert call(m, world, "write", "status", {}, name="open")["found"]
        assert m.unsandboxed_reason(world["servers"]["open"], "write") == spec["sandbox"]["reason"]
    finally:
        m.close()


def test_a_production_worker_refuses_to_start(world: dict[str, Any]) -> None:
    spec = hostile_spec(world["tools"])
    spec["sandbox"] = {"enabled": False}
    path = write_servers(world["base"], {"open": spec})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")}
    env.update({"PROOFLINE_ENVIRONMENT": "production", "PROOFLINE_SERVERS_FILE": str(path),
                "PROOFLINE_BROKER_URL": "redis://127.0.0.1:1/0"})  # nothing listens: it must never consume
    proc = subprocess.run([sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "--pool", "solo",
                           "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", "refuse@%h"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode != 0
    assert "configuration_error" in proc.stderr + proc.stdout and "'open'" in proc.stderr + proc.stdout


# --- through a real worker -------------------------------------------------------------------------

CONTRACT = """
action_type: {action}
version: 1
server: {server}
tool: {tool}
operation: {tool}
target_type: box
result: {{mode: structured}}
timeout_seconds: 30
precondition_read: {{tool: status, arguments: {{}}}}
verification:
  max_duration_seconds: 1
  poll_interval_seconds: 0.2
  read: {{tool: status, arguments: {{}}}}
  expected: ["after.found"]
recovery: {{verification_failure: manual}}
"""


OPEN_REASON = "vendor tool needs the host's devices; reviewed by security"


def start_hostile_stack(tmp: Path, actions: list[tuple[str, str, str]],
                        servers_for: Callable[[Path], dict[str, Any]],
                        contracts_text: dict[str, str] | None = None,
                        private_tmp: Path | None = None) -> Iterator[Stack]:
    """A real stack whose servers file adds ``servers_for(tools folder)`` and whose contracts add
    one (action, server, tool) contract each, and ``contracts_text`` by action; one worker.
    ``private_tmp`` is the workers' ``TMPDIR``: their session files there are theirs alone (every
    worker on the machine reaps the files of dead processes in its temporary folder)."""
    keys = tmp / "keys"
    keys.mkdir()
    (keys / "controller.key").write_text(json.dumps({"private_key": KEY_CANARY}))
    contracts = tmp / "contracts"
    shutil.copytree(ROOT / "contracts", contracts)
    for action, server, tool in actions:
        (contracts / f"{action}.yaml").write_text(CONTRACT.format(action=action, server=server, tool=tool))
    for action, text in (contracts_text or {}).items():
        (contracts / f"{action}.yaml").write_text(text)
    s = build_stack("stdio", tmp, extra_env={"PROOFLINE_CONTRACTS_DIR": str(contracts), "PROOFLINE_KEYS_DIR": str(keys),
                                             **({"TMPDIR": str(private_tmp)} if private_tmp else {})})
    try:
        tools = tmp / "tools"
        tools.mkdir()
        shutil.copy(HOSTILE, tools / "hostile_server.py")
        servers = yaml.safe_load(s.servers_file.read_text())
        servers["servers"].update(servers_for(tools))
        s.servers_file.write_text(yaml.safe_dump(servers))
        s.settings = s.settings.model_copy(update={"contracts_dir": contracts})
        start_workers(s, concurrency=1)
        yield s
    finally:
        teardown_stack(s)


@pytest.fixture(scope="module")
def hostile_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from start_hostile_stack(
        tmp_path_factory.mktemp("hostile-stack"),
        [("hostile.probe", "hostile", "probe"), ("hostile.spin", "hostile", "spin"), ("open.status", "open", "status")],
        lambda tools: {"hostile": hostile_spec(tools, cpu_seconds=4),
                       "open": {**hostile_spec(tools), "sandbox": {"enabled": False, "reason": OPEN_REASON}}})


def publish_hostile(s: Stack, tool: str, arguments: dict[str, Any], server: str = "hostile",
                    described_as: str | None = None) -> str:
    """Publish ``server.tool``, its live description read from ``described_as`` (default: the
    server itself; a twin running the same program, for a server that takes minutes to start)."""
    from proofline.controller import describe_server

    env = s.envelope(f"{server}.{tool}", arguments=arguments, target={"type": "box", "id": "b1"},
                     live=describe_server(s.settings, described_as or server), evidence={"redact_fields": []})
    s.publish(env)
    return env.action_id


def worker_pids(s: Stack) -> list[int]:
    pids = []
    for w in s.workers:
        proc = psutil.Process(w.pid)
        pids += [proc.pid] + [c.pid for c in proc.children(recursive=True) if c.name().startswith(("python", "celery"))]
    return pids


def test_through_a_real_worker_the_hostile_server_gets_nothing(hostile_stack: Stack) -> None:
    s = hostile_stack
    pids = worker_pids(s)
    aid = publish_hostile(s, "probe", {"worker_pids": pids, "files": [str(s.servers_file), str(ROOT / "servers.yaml"),
                                                                      str(s.workdir / "keys" / "controller.key")],
                                       "dirs": [str(s.workdir)]})
    s.wait_event(aid, "tool_called", timeout=60)
    timeline = s.timeline(aid)
    called = next(e for e in timeline if e["event"] == "tool_called")["evidence"]
    # The result is stored once, on the action row (the event carries its digest).
    got = s.action(aid).result["values"]
    assert got["uid"] == 65534 and got["environs"]["self"]["HOSTILE_MARK"] == "explicit-env-only"
    ledger_text = json.dumps([e["evidence"] for e in timeline])
    assert CANARY_SECRET not in ledger_text and KEY_CANARY not in ledger_text
    assert not any(p in got["visible_pids"] for p in pids)
    assert len(got["files"]) == 3 and not any(r["ok"] for r in got["files"])
    # Its working folder is the only part of the stack's folder it sees.
    assert got["dirs"][str(s.workdir)]["entries"] == ["tools", "var"]
    assert not any(r["ok"] for r in got["tcp"].values())
    assert "unsandboxed" not in called


def test_through_a_real_worker_a_killed_server_is_a_recorded_violation(hostile_stack: Stack) -> None:
    s = hostile_stack
    aid = publish_hostile(s, "spin", {"seconds": 120})
    s.wait_event(aid, "sandbox_violation", timeout=90)
    timeline = s.timeline(aid)
    violation = next(e for e in timeline if e["event"] == "sandbox_violation")["evidence"]
    assert violation["signal_name"] in ("SIGKILL", "SIGXCPU") and violation["server"] == "hostile"
    called = next(e for e in timeline if e["event"] == "tool_called")["evidence"]
    assert called["outcome"] == "unknown_outcome"
    # The worker lives on and opens a fresh sandbox for the next call.
    assert s.workers_alive()
    aid2 = publish_hostile(s, "probe", {"worker_pids": [], "files": [], "dirs": []})
    wait_for(lambda: "tool_called" in s.events(aid2), 60, what="the next call after the kill")


def test_through_a_real_worker_an_unsandboxed_servers_reason_is_on_every_call(hostile_stack: Stack) -> None:
    s = hostile_stack
    aid = publish_hostile(s, "status", {}, server="open")
    s.wait_event(aid, "tool_called", timeout=60)
    called = next(e for e in s.timeline(aid) if e["event"] == "tool_called")["evidence"]
    assert called["unsandboxed"] == OPEN_REASON
