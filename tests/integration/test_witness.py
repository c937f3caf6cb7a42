"""The witness relay against the real demo server, on stdio and streamable HTTP: every tools/call
it forwards is counted once, with the canonical hash of its arguments and the idempotency key from
``_meta``; a call the server rejects is still recorded as forwarded, with its error; a cancel is
recorded; and on a test stack the runtime's calls are seen with the key the ledger holds."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError

from ledger.states import Outcome
from proofline.envelope import arguments_hash
from proofline.settings import ROOT
from proofline_kit import zygote
from proofline_kit.processes import start_process, stop_process, wait_port_file
from proofline_kit.sor import store as sor
from proofline_kit.witness import WitnessLog
from proofline_kit.witness.placement import http_relay_argv
from tests.conftest import Stack, wait_for
from tests.helpers import ticket_env

KEY = "proofline/idempotency_key"


@pytest.fixture(params=["stdio", "http"])
def relayed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Any, WitnessLog, Path]]:
    """(client target, witness log, sor database): the demo writer behind a witness relay."""
    db, log = tmp_path / "sor.sqlite3", tmp_path / "witness.jsonl"
    sor.init_db(db)
    sor.seed_demo(db)
    if request.param == "stdio":
        server = [sys.executable, "-m", "proofline_kit.sor", "--transport", "stdio"]
        target = StdioServerParameters(
            command=sys.executable, args=["-m", "proofline_kit.witness", "stdio", "--log", str(log), "--name", "sor",
                                          "--", *server],
            env={"SOR_DB": str(db), "SOR_ROLE": "writer", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
        yield target, WitnessLog(log), db
        return
    procs = [start_process([sys.executable, "-m", "proofline_kit.sor", "--transport", "http", "--port", "0",
                            "--port-file", str(tmp_path / "sor.port"), "--role", "writer", "--db", str(db), "--sse"],
                           {}, tmp_path / "sor.log")]
    try:
        port = wait_port_file(tmp_path / "sor.port", procs[0])
        port_file = tmp_path / "witness.port"
        procs.append(start_process(http_relay_argv(log, "sor", port_file, upstream=f"http://127.0.0.1:{port}/mcp"),
                                   {}, tmp_path / "witness.out"))
        yield f"http://127.0.0.1:{wait_port_file(port_file, procs[1])}/mcp", WitnessLog(log), db
    finally:
        for proc in procs:
            stop_process(proc)


def call(target: Any, *calls: tuple[str, dict[str, Any], str], timeout: float = 10.0) -> list[Any]:
    """Make each (tool, arguments, key) call in one session; an MCP error is returned, not raised."""
    async def run() -> list[Any]:
        out: list[Any] = []
        async with Client(target, read_timeout_seconds=timeout) as client:
            for tool, arguments, key in calls:
                try:
                    out.append(await client.call_tool(tool, arguments, meta={KEY: key},
                                                      read_timeout_seconds=timeout))
                except MCPError as exc:
                    out.append(exc)
        return out

    return anyio.run(run)


def test_calls_are_counted_hashed_and_keyed(relayed) -> None:
    target, witness, db = relayed
    keys = [f"k-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    arguments = [{"tenant": "acme", "title": f"t{i}", "owner": "ops"} for i in range(3)]
    # The second key is sent twice: the server deduplicates, but both requests reached it.
    results = call(target, *[("create_ticket", a, k) for a, k in zip(arguments, keys, strict=True)],
                   ("create_ticket", arguments[1], keys[1]))
    assert [r.is_error for r in results] == [False] * 4
    assert witness.count(tool="create_ticket") == 4
    assert [witness.count(key=k) for k in keys] == [1, 2, 1]
    assert [sor.count_effects(db, k) for k in keys] == [1, 1, 1]
    seen = witness.calls(key=keys[0])[0]
    assert seen.arguments_sha256 == arguments_hash(arguments[0]) != arguments_hash(arguments[1])
    assert (seen.server, seen.tool, seen.is_error) == ("sor", "create_ticket", False)
    assert witness.count(tool="get_ticket") == 0  # list_tools and other traffic are not calls


def test_a_rejected_call_is_recorded_as_forwarded(relayed) -> None:
    target, witness, db = relayed
    ticket = sor.put_ticket(db, "acme", "to close", "ops")
    stale = sor.get_ticket(db, ticket)["ticket"]["version"]
    sor.bump_version(db, "ticket", ticket)
    key = f"k-{uuid.uuid4().hex[:8]}"
    [result] = call(target, ("close_ticket", {"ticket_id": ticket, "expected_version": stale}, key))
    assert result.is_error
    assert sor.count_effects(db, key) == 0
    [seen] = witness.calls(key=key)
    assert (seen.tool, seen.is_error, seen.answered) == ("close_ticket", True, True)


def test_a_cancelled_call_is_recorded_with_its_cancel(relayed) -> None:
    target, witness, db = relayed
    sor.set_fault(db, "create_ticket", "delay", remaining=1, delay_seconds=3.0)
    key = f"k-{uuid.uuid4().hex[:8]}"
    try:
        [result] = call(target, ("create_ticket", {"tenant": "acme", "title": "slow", "owner": "ops"}, key),
                        timeout=0.5)
    finally:
        sor.clear_faults(db)
    assert isinstance(result, MCPError)
    # The client's cancel reaches the relay on its own (over HTTP a separate request, or the closed
    # connection), after the call has already returned here: wait for its record, not for a time.
    wait_for(lambda: witness.cancels(), 30, what="the relay to record the cancel")
    [seen] = witness.calls(key=key)
    assert seen.cancelled and not seen.answered
    assert [c["idempotency_key"] for c in witness.cancels()] == [key]


@pytest.mark.parametrize("code", [0, 3, -9])
def test_the_stdio_relay_exits_as_its_server_did(tmp_path: Path, code: int) -> None:
    """The worker reads the sandbox's exit status for violations: the relay must not hide one."""
    body = f"import os, signal; os.kill(os.getpid(), {-code})" if code < 0 else f"raise SystemExit({code})"
    proc = zygote.run([sys.executable, "-m", "proofline_kit.witness", "stdio", "--log", str(tmp_path / "w.jsonl"),
                           "--name", "x", "--", sys.executable, "-c", body], stdin=subprocess.DEVNULL, timeout=30,
                          cwd=ROOT)
    assert proc.returncode == code


@pytest.mark.parametrize("stack", ["stdio", "http"], indirect=True)
def test_the_stack_routes_every_call_through_the_witness(stack: Stack) -> None:
    env = ticket_env(stack)
    start = stack.witness.mark()
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert row.outcome == Outcome.completed_verified
    [seen] = stack.witness.calls(key=env.idempotency_key)
    assert (seen.server, seen.tool, seen.action_id) == ("sor", env.tool.name, env.action_id)
    assert seen.arguments_sha256 == env.arguments_hash and seen.is_error is False
    assert stack.effects(env.idempotency_key) == 1
    # Verification read the record through the read identity, which has its own relay.
    assert stack.witness.calls(server="sor:read", since=start)
