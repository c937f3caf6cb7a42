"""``proofline gateway``: an agent using the MCP SDK's own client against Proofline as an MCP server.

One stack (real Postgres, Redis, a Celery worker, the system-of-record server) under a signed
authority policy, and the gateway as its own process on loopback. Two agents hold bearer tokens:
``ops`` (tenant acme: create, close, refund) and ``beta`` (tenant beta: create only). Through the
gateway: the tool lists are each agent's own, a create is verified end to end, a close becomes a
proposal that an approver approves, a refund is refused by the policy's read mode, a call naming
another tenant is refused before anything is published, and a retried call is one action."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import httpx2
import pytest
import yaml
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from ledger.states import ActionStatus, Outcome
from proofline.authority import AuthorityPolicy, sign_policy
from proofline.gateway.agents import new_token
from proofline.keys import KeyRole, add_approver, load_signing_key
from proofline_kit.sor import store as sor
from recovery import proposals
from tests.conftest import build_stack, start_process, start_workers, stop_process, teardown_stack, wait_for
from tests.helpers import new_account, uid
from worker.dispatch import CeleryDispatch


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("gateway")
    policy_file = tmp / "authority.json"
    stack = build_stack("stdio", tmp / "stack", extra_env={"PROOFLINE_AUTHORITY_FILE": str(policy_file)})
    proc = None
    try:
        add_approver(stack.settings.keyring_file, tmp / "alice.key", "alice@example.com", development=True)
        alice = load_signing_key(tmp / "alice.key", KeyRole.approver)
        policy = AuthorityPolicy.model_validate({"version": 1, "default_mode": "approved", "action_types": {
            "ticket.create": {"mode": "autonomous", "bounds": {"conditions": ["args.owner == 'ops'"],
                                                                "max_actions_per_tenant": 1000}},
            "ticket.close": {"mode": "propose"},
            "refund.issue": {"mode": "read"}}})
        policy_file.write_text(json.dumps(sign_policy(policy, alice)))
        start_workers(stack)
        tokens = {name: new_token() for name in ("ops", "beta")}
        agents = tmp / "agents.yaml"
        agents.write_text(yaml.safe_dump({"agents": {
            "ops": {"token_sha256": tokens["ops"][1], "workload_identity": "agent:ops-bot", "requester": "dana@acme.test",
                    "tenant": "acme", "action_types": ["ticket.create", "ticket.close", "refund.issue"]},
            "beta": {"token_sha256": tokens["beta"][1], "workload_identity": "agent:beta-bot",
                     "requester": "eve@beta.test", "tenant": "beta", "action_types": ["ticket.create"]}}}))
        port_file = tmp / "gateway.port"
        proc = start_process([sys.executable, "-m", "proofline", "gateway", "--agents", str(agents), "--port", "0",
                              "--port-file", str(port_file), "--wait", "45",
                              "--console-url", "http://127.0.0.1:8080"], stack.env, tmp / "gateway.log")
        wait_for(port_file.exists, 30, what="the gateway to listen")
        url = f"http://127.0.0.1:{port_file.read_text()}/mcp"
        yield {"stack": stack, "url": url, "tokens": {k: v[0] for k, v in tokens.items()}, "alice": alice,
               "settings": stack.settings.model_copy(update={"authority_file": policy_file})}
    finally:
        if proc is not None:
            stop_process(proc)
        teardown_stack(stack)


def agent_session(gw: dict[str, Any], agent: str, *steps: Any) -> list[Any]:
    """Run ``steps`` (async functions of an MCP client) as ``agent``, in one session; their results."""

    async def go() -> list[Any]:
        headers = {"Authorization": f"Bearer {gw['tokens'][agent]}"}
        async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(60.0)) as http:
            async with Client(streamable_http_client(gw["url"], http_client=http)) as client:
                return [await step(client) for step in steps]

    return anyio.run(go)


def call(name: str, arguments: dict[str, Any], key: str | None = None):  # noqa: ANN201
    async def step(client: Client) -> Any:
        return await client.call_tool(name, arguments, read_timeout_seconds=60,
                                      meta={"proofline/idempotency_key": key} if key else None)
    return step


async def list_tools(client: Client) -> list[str]:
    return sorted(t.name for t in (await client.list_tools()).tools)


def create_args(tenant: str = "acme") -> dict[str, Any]:
    return {"target": {"id": "acme-ops"}, "arguments": {"tenant": tenant, "title": f"gw-{uid()}", "owner": "ops"}}


def test_without_a_token_nothing_is_served(gw: dict[str, Any]) -> None:
    for headers in ({}, {"Authorization": "Bearer plg_not-a-token"}):
        answer = httpx2.post(gw["url"], headers={**headers, "Content-Type": "application/json",
                                                  "Accept": "application/json, text/event-stream"},
                             json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert answer.status_code == 401 and answer.headers["www-authenticate"].startswith("Bearer")


def test_each_agent_lists_its_own_governed_tools(gw: dict[str, Any]) -> None:
    [ops] = agent_session(gw, "ops", list_tools)
    [beta] = agent_session(gw, "beta", list_tools)
    assert ops == ["proofline_action_status", "refund.issue", "ticket.close", "ticket.create"]
    assert beta == ["proofline_action_status", "ticket.create"]

    async def schema(client: Client) -> dict[str, Any]:
        tool = next(t for t in (await client.list_tools()).tools if t.name == "ticket.create")
        assert "Governed by Proofline" in (tool.description or "")
        return tool.input_schema

    [create] = agent_session(gw, "ops", schema)
    assert set(create["properties"]) == {"target", "arguments"}
    assert set(create["properties"]["arguments"]["required"]) >= {"tenant", "title", "owner"}


def test_a_call_is_published_verified_and_answered_with_the_proven_outcome(gw: dict[str, Any]) -> None:
    stack = gw["stack"]
    [result] = agent_session(gw, "ops", call("ticket.create", create_args(), key=f"k-{uid()}"))
    body = result.structured_content
    assert not result.is_error and body["outcome"] == Outcome.completed_verified.value, body
    assert body["console"].endswith(f"/actions/{body['action_id']}")
    row = stack.action(body["action_id"])
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    with stack.conn.cursor() as cur:
        cur.execute("SELECT envelope FROM actions WHERE action_id = %s", (body["action_id"],))
        envelope = cur.fetchone()["envelope"]
    # The credential decided who acts and for whom; the agent's request is named in the request context.
    assert (envelope["tenant"], envelope["workload_identity"], envelope["requester"]) == (
        "acme", "agent:ops-bot", "dana@acme.test")
    assert envelope["approval"]["id"].startswith("gateway:ops:mcp-request:")
    assert stack.effects(envelope["idempotency_key"]) == 1


def test_a_retried_call_with_the_same_key_is_the_same_action(gw: dict[str, Any]) -> None:
    key, args = f"k-{uid()}", create_args()
    first, second = agent_session(gw, "ops", call("ticket.create", args, key), call("ticket.create", args, key))
    assert first.structured_content["action_id"] == second.structured_content["action_id"]
    with gw["stack"].conn.cursor() as cur:
        cur.execute("SELECT envelope->>'idempotency_key' AS k FROM actions WHERE action_id = %s",
                    (first.structured_content["action_id"],))
        assert gw["stack"].effects(cur.fetchone()["k"]) == 1


def test_a_proposal_is_answered_as_such_and_runs_once_approved(gw: dict[str, Any]) -> None:
    stack = gw["stack"]
    ticket = sor.put_ticket(stack.sor_db, "acme", f"to close {uid()}", "ops")
    version = sor.get_ticket(stack.sor_db, ticket)["ticket"]["version"]
    [result] = agent_session(gw, "ops", call("ticket.close", {
        "target": {"id": ticket, "expected_version": version},
        "arguments": {"ticket_id": ticket, "expected_version": version}}))
    body = result.structured_content
    assert not result.is_error and body["status"] == ActionStatus.proposed.value, body
    assert "approver" in body["message"]
    proposals.approve(gw["settings"], stack.operator, CeleryDispatch(stack.app), body["action_id"], gw["alice"])
    stack.wait_settled(body["action_id"])
    [status] = agent_session(gw, "ops", call("proofline_action_status", {"action_id": body["action_id"]}))
    assert status.structured_content["outcome"] == Outcome.completed_verified.value
    assert sor.get_ticket(stack.sor_db, ticket)["ticket"]["status"] == "closed"
    # Another agent cannot read it.
    [other] = agent_session(gw, "beta", call("proofline_action_status", {"action_id": body["action_id"]}))
    assert other.is_error and other.structured_content["refused"] == "unknown_action"


def test_a_call_the_policy_refuses_is_answered_as_refused(gw: dict[str, Any]) -> None:
    account = new_account(gw["stack"])
    [result] = agent_session(gw, "ops", call("refund.issue", {
        "target": {"id": account}, "arguments": {"account": account, "amount_cents": 500, "tenant": "acme", "reason": "gateway test"}}))
    body = result.structured_content
    assert "outcome" in body, body
    assert result.is_error and (body["outcome"], body["reason_code"]) == (Outcome.not_started.value,
                                                                          "authority_mode_refused"), body


def test_a_credential_for_another_tenant_is_refused_before_anything_is_published(gw: dict[str, Any]) -> None:
    stack = gw["stack"]
    with stack.conn.cursor() as cur:
        cur.execute("SELECT count(*) AS n FROM actions")
        before = cur.fetchone()["n"]
    [result] = agent_session(gw, "beta", call("ticket.create", create_args(tenant="acme")))
    assert result.is_error and result.structured_content["refused"] == "tenant_mismatch"
    [denied] = agent_session(gw, "beta", call("ticket.close", {"target": {"id": "x"}, "arguments": {}}))
    assert denied.is_error and denied.structured_content["refused"] == "action_type_not_permitted"
    with stack.conn.cursor() as cur:
        cur.execute("SELECT count(*) AS n FROM actions")
        assert cur.fetchone()["n"] == before
