"""Requests a tool server sends mid-call (elicitation, sampling, roots) under the runtime's policy
(worker/server_requests.py): refused by default with the protocol's error, each one recorded on the
action whose call was in flight, roots answered with the sandbox's declared paths when the servers
file says so, a flood bounded, nothing announced that would be refused, and the action still
classified and verified.

Real sandboxed stdio sessions of the system-of-record server on both protocol generations (the
2025-11-25 handshake, where the requests come on the session, and 2026-07-28, where they come
embedded in an ``InputRequiredResult``), then a real Celery worker writing them to the ledger.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from mcp.shared.exceptions import MCPError

from ledger.states import ActionStatus, Outcome
from proofline.errors import ConfigurationError
from proofline.server_requests import ServerRequestPolicy
from proofline.settings import ROOT
from proofline_kit import zygote
from proofline_kit.sor import store as sor
from proofline_kit.sor.asks import asks_path
from proofline_kit.sor.db import init_db
from tests.conftest import Stack
from tests.helpers import evidence_of, ticket_env
from worker.mcp_client import McpSessions
from worker.server_requests import SUPPRESSED_EVENT
from worker.servers import load_servers

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is needed")

METHODS = {"roots/list", "elicitation/create", "sampling/createMessage"}


def sor_servers(base: Path, protocol: str, **requests: Any) -> dict[str, Any]:
    """A servers file with the system of record over sandboxed stdio, its database under ``var``."""
    (base / "var").mkdir(exist_ok=True)
    db = init_db(base / "var" / "sor.db")
    spec: dict[str, Any] = {
        "transport": "stdio", "command": ["{python}", "-m", "proofline_kit.sor", "--transport", "stdio"],
        "env": {"SOR_ROLE": "writer", "SOR_DB": str(db), "PYTHONPATH": str(ROOT)}, "cwd": "var",
        "protocol": protocol, "sandbox": {"rw_paths": ["var"]},
        "read_identity": {"env": {"SOR_ROLE": "reader"}, "sandbox": {"uid": 65533, "ro_paths": ["var"]}},
    }
    if requests:
        spec["server_requests"] = requests
    path = base / f"servers-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump({"servers": {"sor": spec}}))
    load_servers.cache_clear()
    return {"server": load_servers(path)["sor"], "db": db}


def create_ticket(m: McpSessions, server: Any, action_id: str) -> Any:
    async def go(client):  # noqa: ANN001
        return await client.call_tool("create_ticket", {"tenant": "acme", "title": "asks", "owner": "ops"},
                                      read_timeout_seconds=60, meta={"proofline/idempotency_key": action_id})

    with m.acting_for(action_id):
        return m.run(server, "write", go)


def server_side(db: Path) -> list[dict[str, Any]]:
    """What the server noted of its requests' answers (without the capabilities line)."""
    return [line for line in _noted(db) if line["method"] != "capabilities"]


def announced(db: Path) -> list[Any]:
    """The client capabilities the server saw, once per time it asked."""
    return [line["answer"] for line in _noted(db) if line["method"] == "capabilities"]


def _noted(db: Path) -> list[dict[str, Any]]:
    path = asks_path(str(db))
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return tmp_path


def one_call(base: Path, protocol: str, fault: str, action_id: str, narrowing: ServerRequestPolicy | None = None,
             **requests: Any) -> tuple[dict[str, Any], Any, list[dict[str, Any]]]:
    """One ``create_ticket`` with ``fault`` armed on a fresh server: the world, the result, what was taken."""
    world = sor_servers(base, protocol, **requests)
    sor.set_fault(world["db"], "create_ticket", fault)
    m = McpSessions(base)
    m.request_policy = narrowing
    try:
        result = create_ticket(m, world["server"], action_id)
        return world, result, m.take_audit()
    finally:
        m.close()


def test_on_the_handshake_protocol_each_request_is_refused_and_recorded(base: Path) -> None:
    world, result, found = one_call(base, "legacy", "server_requests", "act-1")
    assert not result.is_error  # the tool went on after its requests were refused: the call completed
    requests = [f for f in found if f.get("_event") == "server_request"]
    assert {r["method"] for r in requests} == METHODS
    assert all(r["action_id"] == "act-1" and r["answer"] == {"refused": -32600} for r in requests)
    elicit = next(r for r in requests if r["method"] == "elicitation/create")
    assert elicit["message"].startswith("Approve closing") and elicit["size"] > 0
    # The server's side: a protocol error for each (no capability was announced, none was granted).
    seen = server_side(world["db"])
    assert {s["method"] for s in seen} == METHODS and all(s["answer"]["error"] == -32600 for s in seen)
    # Nothing was announced that the policy refuses, although the client holds a callback for each.
    assert all(not ({"sampling", "elicitation", "roots"} & set(caps or {})) for caps in announced(world["db"]))


def test_on_the_current_protocol_the_embedded_requests_are_refused_and_the_call_fails(base: Path) -> None:
    world = sor_servers(base, "auto")
    sor.set_fault(world["db"], "create_ticket", "server_requests")
    m = McpSessions(base)
    try:
        with pytest.raises(MCPError) as raised:
            create_ticket(m, world["server"], "act-2")
        found = m.take_audit()
    finally:
        m.close()
    assert "refused by the runtime's policy" in str(raised.value)  # our refusal is what the call failed on
    requests = [f for f in found if f.get("_event") == "server_request"]
    assert requests and {r["method"] for r in requests} <= METHODS
    assert all(r["answer"] == {"refused": -32600} and r["action_id"] == "act-2" for r in requests)
    assert sor.count_effects(world["db"], "act-2") == 0  # the first round applies nothing; no round followed
    assert server_side(world["db"]) == []


@pytest.mark.parametrize("protocol", ["legacy", "auto"])
def test_roots_are_answered_with_the_sandbox_paths_when_the_servers_file_says_so(base: Path, protocol: str) -> None:
    world, result, found = one_call(base, protocol, "ask_roots", "act-3", roots="sandbox")
    assert not result.is_error
    var = (base / "var").resolve().as_uri()
    [request] = [f for f in found if f.get("_event") == "server_request"]
    assert request["method"] == "roots/list" and request["answer"] == {"roots": [var]}
    [answer] = server_side(world["db"])
    assert [r["uri"] for r in answer["answer"]["roots"]] == [var]
    if protocol == "legacy":  # what the servers file answers is announced, and only that
        [caps] = announced(world["db"])
        assert "roots" in caps and not ({"sampling", "elicitation"} & set(caps))
    assert sor.count_effects(world["db"], "act-3") == 1


def test_a_contract_narrowing_refuses_roots_its_server_would_answer(base: Path) -> None:
    world, _, found = one_call(base, "legacy", "ask_roots", "act-4", ServerRequestPolicy(roots="refuse"),
                               roots="sandbox")
    [request] = [f for f in found if f.get("_event") == "server_request"]
    assert request["answer"] == {"refused": -32600}
    assert server_side(world["db"])[0]["answer"]["error"] == -32600


def test_a_flood_of_requests_is_bounded_and_counted(base: Path) -> None:
    world = sor_servers(base, "legacy", max_per_call=1)
    sor.set_fault(world["db"], "create_ticket", "server_requests", remaining=2)
    m = McpSessions(base)
    try:
        create_ticket(m, world["server"], "act-5")
        first = m.take_audit()
        create_ticket(m, world["server"], "act-6")
        second = m.take_audit()
    finally:
        m.close()
    for found, action in ((first, "act-5"), (second, "act-6")):
        assert len([f for f in found if f.get("_event") == "server_request"]) == 1
        [summary] = [f for f in found if f.get("_event") == SUPPRESSED_EVENT]
        assert summary == {"_event": SUPPRESSED_EVENT, "server": "sor", "role": "write", "suppressed": 2,
                           "recorded": 1, "in_flight": True, "action_id": action}


def test_roots_from_a_sandbox_need_a_sandboxed_stdio_server(base: Path) -> None:
    path = base / "servers.yaml"
    path.write_text(yaml.safe_dump({"servers": {"remote": {
        "transport": "http", "url": "http://127.0.0.1:9/mcp", "read_identity": {},
        "server_requests": {"roots": "sandbox"}}}}))
    load_servers.cache_clear()
    with pytest.raises(ConfigurationError, match="roots: sandbox needs a sandboxed stdio server"):
        load_servers(path)


def test_through_a_worker_the_requests_are_ledger_events_and_the_action_is_verified(stack: Stack) -> None:
    env = ticket_env(stack)
    sor.set_fault(stack.sor_db, "create_ticket", "server_requests")
    try:
        stack.publish(env)
        row = stack.wait_settled(env.action_id, timeout=60)
    finally:
        sor.clear_faults(stack.sor_db, "create_ticket")
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
    requests = evidence_of(stack, env.action_id, "server_request")
    assert requests and {r["method"] for r in requests} <= METHODS
    assert all(r["answer"] == {"refused": -32600} and r["server"] == "sor" for r in requests)
    # The refused round changed nothing; the call that followed created exactly one ticket.
    assert stack.effects(env.idempotency_key) == 1

    # The refused round is not taken for a refusal by the server: it was sent, so a read decided it.
    first, *rest = evidence_of(stack, env.action_id, "tool_called")
    assert (first["outcome"], first["reason_code"]) == (Outcome.unknown_outcome.value, "server_request_refused")
    assert [c["outcome"] for c in rest] == [Outcome.completed_unverified.value]


def test_a_protocol_version_other_than_the_pinned_one_is_refused_at_revalidation(tmp_path: Path) -> None:
    """``contracts pin`` records what the session negotiated; a worker whose session negotiates
    another protocol version than the pin (as after a server upgrade) refuses the action as
    ``tool_contract_changed`` naming it, and calls nothing; pinned again, the same server is verified."""
    import sys

    from proofline.pins import read_pins, write_pins
    from tests.conftest import build_stack, start_workers, teardown_stack

    pins = tmp_path / "pins.json"
    s = build_stack("stdio", tmp_path / "stack", extra_env={"PROOFLINE_PINS_FILE": str(pins)})
    try:
        def pin() -> None:
            done = zygote.run([sys.executable, "-m", "proofline", "contracts", "pin", "--by", "test"], env=s.env,
                                  cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr

        pin()
        live = read_pins(pins)["sor"]
        assert live.protocol_version and "tools" in (live.capabilities or {})
        write_pins(pins, {**read_pins(pins), "sor": dataclasses.replace(live, protocol_version="2025-11-25")})
        start_workers(s)
        env = ticket_env(s)
        s.publish(env)
        row = s.wait_settled(env.action_id, timeout=60)
        assert (row.outcome, row.reason_code) == (Outcome.not_started, "tool_contract_changed")
        assert s.witness.count(key=env.idempotency_key) == 0
        detail = json.dumps(s.timeline(env.action_id), default=str)
        assert f"protocol version '{live.protocol_version}', pinned '2025-11-25'" in detail
        pin()  # reviewed again: the same server as it negotiates now
        again = ticket_env(s)
        s.publish(again)
        assert s.wait_settled(again.action_id, timeout=60).outcome == Outcome.completed_verified
    finally:
        teardown_stack(s)
