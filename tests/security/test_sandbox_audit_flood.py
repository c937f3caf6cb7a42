"""The sandbox audit under load and when things die (worker/sandbox_reader.py, worker/deathsig.py).

A flood of denied syscalls is counted to the last line; a session dropped mid-flood reads strace to
its end; what the audit could not read is an overflow record with its counts, and a fail-closed
server's call is refused on it; a worker process killed while it starts an audited server leaves
no tracer and no audit folder behind.

Real bubblewrap and strace, real MCP sessions; the last tests run behind a real Celery worker.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from proofline.errors import SandboxAuditOverflow
from proofline_kit.processes import gone, stop_processes
from proofline_kit.stack import start_workers
from tests.conftest import Stack, wait_for
from tests.security import test_sandbox
from tests.security.test_sandbox import hostile_spec, open_sessions, publish_hostile
from tests.security.test_sandbox_audit import run_tool
from worker.mcp_client import McpSessions, sandbox_violations
from worker.sandbox_reader import MAX_KEPT, OVERFLOW_EVENT, reap_orphans

world = test_sandbox.world
FLOOD = 100_000

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("strace") is None,
                                reason="bubblewrap (bwrap) and strace are needed")


def counted(found: list[dict[str, Any]], path: str) -> int:
    """Violations on ``path`` in a take: those kept, plus the summary of the ones past the limit."""
    return sum(1 for f in found if f.get("path") == path) + sum(f["count"] for f in found if f["kind"] == "suppressed")


def overflows(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [f for f in found if f.get("_event") == OVERFLOW_EVENT]


def dropped_mid_flood(world: dict[str, Any], **sandbox: Any) -> tuple[Any, list[dict[str, Any]]]:
    """A call that keeps opening a hidden path for far longer than its timeout, then the session
    dropped as the worker drops a session whose call failed after it was sent: (auditor, take)."""
    async def go(client):  # noqa: ANN001
        return await client.call_tool("flood", {"path": "/etc/shadow", "count": 0, "seconds": 60},
                                      read_timeout_seconds=2)

    m = open_sessions(world, hostile=hostile_spec(world["tools"], **sandbox))
    server = world["servers"]["hostile"]
    try:
        run_tool(m, server, "write", "status", {})
        auditor = m._sessions[("hostile", "write")].auditor  # noqa: SLF001
        assert auditor is not None
        with pytest.raises(Exception):  # noqa: B017 - the SDK's request timeout
            m.run(server, "write", go)
        m.discard(server, "write")
        return auditor, m.take_audit()
    finally:
        m.close()


def test_a_flood_of_denied_opens_is_counted_to_the_last(world: dict[str, Any]) -> None:
    m = open_sessions(world, hostile=hostile_spec(world["tools"]))
    server = world["servers"]["hostile"]
    try:
        assert run_tool(m, server, "write", "status", {})["found"]
        assert m.take_audit() == []
        before = sandbox_violations()
        got = run_tool(m, server, "write", "flood", {"path": "/etc/shadow", "count": FLOOD})
        found = m.take_audit()
        auditor = m._sessions[("hostile", "write")].auditor  # noqa: SLF001
    finally:
        m.close()
    assert got["failed"] == FLOOD
    # Every one counted: the first MAX_KEPT kept as evidence, the rest in the summary; nothing lost.
    assert counted(found, "/etc/shadow") == FLOOD, json.dumps(found[-2:])
    assert len([f for f in found if f["kind"] == "hidden_path"]) == MAX_KEPT
    assert overflows(found) == [] and auditor is not None and auditor.dropped == 0
    assert sandbox_violations() == before + FLOOD


def test_a_session_dropped_mid_flood_reads_strace_to_its_end(world: dict[str, Any],
                                                             capfd: pytest.CaptureFixture[str]) -> None:
    auditor, found = dropped_mid_flood(world)
    # Read to the end (strace closed its end once the server was gone), so nothing is unaccounted
    # for and strace never wrote into a closed pipe.
    assert auditor.ended and auditor.dropped == 0 and overflows(found) == []
    assert counted(found, "/etc/shadow") == auditor.total > MAX_KEPT
    assert all(f["in_flight"] for f in found)
    assert "Broken pipe" not in capfd.readouterr().err
    assert not os.path.exists(auditor.directory)


def test_a_session_closed_before_straces_end_is_an_overflow_record(world: dict[str, Any]) -> None:
    """No time to drain (``drain_seconds: 0``): what was read is counted, the rest is said to be missing."""
    auditor, found = dropped_mid_flood(world, audit={"drain_seconds": 0})
    [lost] = overflows(found)
    assert lost["reason"] == "closed_before_end" and lost["server"] == "hostile" and lost["in_flight"]
    assert lost["lines_seen"] > MAX_KEPT and lost["violations"] == counted(found, "/etc/shadow")
    assert lost["lines_dropped"] == 0 and lost["unread_bytes"] >= 0
    assert not auditor.ended


def oversize(m: McpSessions, server: Any) -> Any:
    async def go(client):  # noqa: ANN001
        return await client.call_tool("exec_long", {"path": "/etc/shadow", "args": 24, "size": 4000},
                                      read_timeout_seconds=60)

    return m.run(server, "write", go)


def test_an_attempt_hidden_in_an_oversize_line_is_an_overflow(world: dict[str, Any]) -> None:
    """A denied exec whose audit line is longer than the reader keeps: not silently skipped. In
    development (``record``) the call stands and the overflow is on it; ``fail_closed`` refuses
    the call, as one that was sent."""
    m = open_sessions(world, hostile=hostile_spec(world["tools"]),
                      strict=hostile_spec(world["tools"], audit={"on_overflow": "fail_closed"}))
    try:
        result = oversize(m, world["servers"]["hostile"])
        assert result.structured_content["ok"] is False
        [lost] = overflows(m.take_audit())
        assert lost["reason"] == "line_too_long" and lost["lines_dropped"] == 1 and lost["lines_seen"] >= 1
        with pytest.raises(SandboxAuditOverflow) as refused:
            oversize(m, world["servers"]["strict"])
        assert refused.value.sent and refused.value.code == "sandbox_audit_overflow"
        [strict] = overflows(m.take_audit())
        assert strict["server"] == "strict" and strict["lines_dropped"] == 1
    finally:
        m.close()


def test_a_server_too_slow_to_start_is_ended_with_its_tracer(world: dict[str, Any]) -> None:
    """A session that does not open in time is abandoned: its server, its tracer and its audit
    folder go with it (nothing keeps tracing, or writing to a pipe nobody reads)."""
    from proofline.errors import McpUnavailable

    sleepy = hostile_spec(world["tools"])
    sleepy["env"] = {**sleepy["env"], "HOSTILE_START_SLEEP": "120"}
    m = open_sessions(world, sleepy=sleepy)
    m.connect_timeout = 3.0  # Settings.mcp_connect_timeout_seconds in a worker
    me = psutil.Process()
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), f"proofline-audit-{os.getpid()}-*")))
    tracers: list[psutil.Process] = []
    refused = threading.Event()

    def note_tracers() -> None:  # the tracers this process starts, noted while the session is refused
        while not refused.wait(0.1):
            tracers.extend(p for p in me.children() if p.name() == "strace" and p not in tracers)

    watcher = threading.Thread(target=note_tracers)
    watcher.start()
    try:
        try:
            with pytest.raises(McpUnavailable, match=r"no session within 3s \(PROOFLINE_MCP_CONNECT_TIMEOUT_SECONDS\)"):
                run_tool(m, world["servers"]["sleepy"], "write", "status", {})
        finally:
            refused.set()
            watcher.join()
        assert tracers, "the audited server was being started"
        wait_for(lambda: all(gone(t) for t in tracers), 20, what="the slow server's tracer to end")
        after = set(glob.glob(os.path.join(tempfile.gettempdir(), f"proofline-audit-{os.getpid()}-*")))
        assert after <= before
    finally:
        m.close()


# --- through a real worker -------------------------------------------------------------------------

#: A contract for one hostile tool, whose call fails closed on an overflow.
STRICT = test_sandbox.CONTRACT.format(action="strict.exec_long", server="strict", tool="exec_long")


def flood_servers(tools: Any) -> dict[str, Any]:
    sleepy = hostile_spec(tools)
    sleepy["env"] = {**sleepy["env"], "HOSTILE_START_SLEEP": "120"}
    return {"hostile": hostile_spec(tools), "strict": hostile_spec(tools, audit={"on_overflow": "fail_closed"}),
            "sleepy": sleepy}


@pytest.fixture(scope="module")
def flood_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Its workers' temporary folder is their own: on a shared one, any worker the machine starts
    # meanwhile (another test's) reaps a killed process's audit folder, and the tests below could
    # not tell whether this worker's watcher or its new pool process did.
    private_tmp = Path(tempfile.mkdtemp(prefix="pl-flood-"))  # short: the session host's socket is in it
    try:
        yield from test_sandbox.start_hostile_stack(tmp_path_factory.mktemp("flood-stack"),
                                                    [("sleepy.status", "sleepy", "status")], flood_servers,
                                                    {"strict.exec_long": STRICT}, private_tmp=private_tmp)
    finally:
        shutil.rmtree(private_tmp, ignore_errors=True)


def test_through_a_real_worker_a_fail_closed_overflow_is_an_unknown_outcome(flood_stack: Stack) -> None:
    s = flood_stack
    aid = publish_hostile(s, "exec_long", {"path": "/etc/shadow", "args": 24, "size": 4000}, server="strict")
    row = s.wait_settled(aid)
    timeline = s.timeline(aid)
    lost = [e["evidence"] for e in timeline if e["event"] == OVERFLOW_EVENT]
    assert lost and lost[0]["reason"] == "line_too_long" and lost[0]["lines_dropped"] == 1, timeline
    called = next(e for e in timeline if e["event"] == "tool_called")["evidence"]
    # Sent, so not "failed before side effect": what the server did is unknown.
    assert called["outcome"] == "unknown_outcome" and called["reason_code"] == "sandbox_audit_overflow", called
    assert row.outcome != "failed_before_side_effect"


def pool_processes(s: Stack) -> list[psutil.Process]:
    """The worker's processes below its supervisor: Celery's main and pool processes, and the
    session host (worker/session_host.py)."""
    found = []
    for w in s.workers:
        for c in psutil.Process(w.pid).children(recursive=True):
            try:
                line = " ".join(c.cmdline())
            except psutil.NoSuchProcess:
                continue
            if "celery" in line or "proofline" in line:
                found.append(c)
    return found


def is_session_host(cmdline: list[str]) -> bool:
    return "worker.session_host" in cmdline


def tracer_of(s: Stack) -> tuple[psutil.Process, psutil.Process] | None:
    """(the process that started an audited server, its strace) once one has."""
    for proc in pool_processes(s):
        for child in proc.children():
            if child.name() == "strace":
                return proc, child
    return None


def killed_while_starting(s: Stack) -> tuple[int, list[str]]:
    """Publish an action on the server that takes minutes to start, SIGKILL the process that is
    starting it under strace, and wait for the tracer and the server to die with it; returns the
    killed process's (pid, command line) once its audit folder is gone too."""
    publish_hostile(s, "status", {}, server="sleepy", described_as="hostile")
    starter, tracer = wait_for(lambda: tracer_of(s), 60, what="a process starting the audited server")
    traced = tracer.children(recursive=True)
    folders = lambda: glob.glob(os.path.join(s.env["TMPDIR"], f"proofline-audit-{starter.pid}-*"))  # noqa: E731
    assert folders() and traced
    cmdline = starter.cmdline()
    os.kill(starter.pid, signal.SIGKILL)
    wait_for(lambda: gone(tracer) and all(gone(p) for p in traced), 20, what="the tracer and server to die")
    wait_for(lambda: not folders(), 60, what="the killed process's audit folder to go")
    assert s.workers_alive()
    return starter.pid, cmdline


def test_the_session_host_killed_while_starting_an_audited_server_leaves_nothing(flood_stack: Stack) -> None:
    # Under the default settings the node's session host starts the stdio servers; the watcher in
    # the worker's main process removes a killed host's audit folders and starts another host.
    pid, cmdline = killed_while_starting(flood_stack)
    assert is_session_host(cmdline), cmdline
    wait_for(lambda: any(p.pid != pid and is_session_host(p.cmdline()) for p in pool_processes(flood_stack)),
             60, what="a new session host")


def test_a_pool_process_killed_while_starting_an_audited_server_leaves_nothing(flood_stack: Stack) -> None:
    # Without a session host a pool process starts its own servers; the pool process Celery starts
    # in the killed one's place removes the folder as it starts. (Last in this module: it replaces
    # the stack's worker with one that runs no host.)
    s = flood_stack
    stop_processes(s.workers)
    s.workers.clear()
    start_workers(s, concurrency=1, env={**s.env, "PROOFLINE_STDIO_SESSION_HOST": "false"})
    _, cmdline = killed_while_starting(s)
    assert not is_session_host(cmdline) and "celery" in " ".join(cmdline), cmdline


def test_the_reaper_leaves_live_processes_files_alone(tmp_path: Any) -> None:
    mine = tmp_path / f"proofline-audit-{os.getpid()}-x"
    mine.mkdir()
    dead = psutil.Popen(["true"])
    dead.wait()
    theirs = tmp_path / f"proofline-audit-{dead.pid}-y"
    theirs.mkdir()
    (theirs / "trace").write_text("")
    status = tmp_path / f"proofline-sandbox-{dead.pid}-z.json"
    status.write_text("{}")
    other = tmp_path / "proofline-audit-legacy"
    other.mkdir()
    assert sorted(reap_orphans(str(tmp_path))) == sorted([str(theirs), str(status)])
    assert mine.exists() and other.exists() and not theirs.exists() and not status.exists()
