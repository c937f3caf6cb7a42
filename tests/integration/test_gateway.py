"""``proofline gateway``: an agent using the MCP SDK's own client against Proofline as an MCP server.

One stack (real Postgres, Redis, a Celery worker, the system-of-record server) under a signed
authority policy, and the gateway as its own process on loopback. Two agents hold bearer tokens:
``ops`` (tenant acme: create, close, refund) and ``beta`` (tenant beta: create only). Through the
gateway: the tool lists are each agent's own, a create is verified end to end, a close becomes a
proposal that an approver approves, a refund is refused by the policy's read mode, a call naming
another tenant is refused before anything is published, and a retried call is one action.

The same gateway over stdio (``--stdio``, the agent chosen by ``PROOFLINE_GATEWAY_TOKEN``); a call
that asks for progress gets the action's ledger stages as ``notifications/progress``; a client that
declares the Tasks extension gets a task (its id the action id) that it polls with ``tasks/get``
and ``tasks/result``, through a proposal and its approval.

Read tools: ``ticket.close.read`` is listed read-only and answers the system of record's current
value through a worker; another tenant's target is refused; a forged or unsigned ``proofline.read``
task is refused by the worker and writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any, Literal

import anyio
import httpx2
import pytest
import yaml
from mcp import Client, StdioServerParameters, types
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from pydantic import Field

from ledger import reads as read_store
from ledger import store as ledger_store
from ledger.redact import scrub_text
from ledger.states import ActionStatus, Outcome
from proofline.authority import AuthorityPolicy, sign_policy
from proofline.gateway.agents import new_token
from proofline.gateway.tasks import IDENTIFIER as TASKS
from proofline.keys import KeyRole, add_approver, load_signing_key
from proofline.reads import sign_request
from proofline_kit.sor import store as sor
from recovery import proposals
from tests.conftest import build_stack, start_process, start_workers, stop_process, teardown_stack, wait_for
from tests.helpers import new_account, uid
from worker.dispatch import CeleryDispatch
from worker.mcp_tasks import _send_call


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
               "settings": stack.settings.model_copy(update={"authority_file": policy_file}), "agents": agents}
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
    assert ops == ["proofline_action_status", "refund.issue", "refund.issue.read", "ticket.close", "ticket.close.read",
                   "ticket.create"]
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


# --- stdio ------------------------------------------------------------------------------------------


def stdio_params(gw: dict[str, Any], token: str) -> StdioServerParameters:
    # StdioServerParameters merges this over a minimal default environment, not os.environ.
    return StdioServerParameters(command=sys.executable, env={**gw["stack"].env, "PROOFLINE_GATEWAY_TOKEN": token},
                                 args=["-m", "proofline", "gateway", "--stdio", "--agents", str(gw["agents"]),
                                       "--wait", "45"])


def stdio_session(gw: dict[str, Any], agent: str, *steps: Any) -> list[Any]:
    async def go() -> list[Any]:
        async with Client(stdio_params(gw, gw["tokens"][agent]), read_timeout_seconds=60) as client:
            return [await step(client) for step in steps]

    return anyio.run(go)


def test_over_stdio_the_agent_is_the_one_whose_token_the_environment_holds(gw: dict[str, Any]) -> None:
    stack = gw["stack"]
    listed, result = stdio_session(gw, "beta", list_tools, call("ticket.create", create_args(tenant="beta")))
    assert listed == ["proofline_action_status", "ticket.create"]
    body = result.structured_content
    assert not result.is_error and body["outcome"] == Outcome.completed_verified.value, body
    with stack.conn.cursor() as cur:
        cur.execute("SELECT envelope FROM actions WHERE action_id = %s", (body["action_id"],))
        envelope = cur.fetchone()["envelope"]
    assert (envelope["tenant"], envelope["workload_identity"]) == ("beta", "agent:beta-bot")
    assert envelope["approval"]["id"].startswith("gateway:beta:mcp-request:")
    assert body["action_id"].startswith("gw-beta-") and stack.effects(envelope["idempotency_key"]) == 1


def test_over_stdio_an_unknown_or_missing_token_serves_nothing(gw: dict[str, Any]) -> None:
    for token in ("plg_not-a-token", ""):
        params = stdio_params(gw, token)
        done = subprocess.run([params.command, *params.args], env=params.env, input="", capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 3, done  # configuration_error
        assert "PROOFLINE_GATEWAY_TOKEN" in done.stderr and done.stdout == "", done


# --- progress ---------------------------------------------------------------------------------------


def progress_call(name: str, arguments: dict[str, Any], seen: list[tuple[float, float | None, str | None]]):  # noqa: ANN201
    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    async def step(client: Client) -> Any:
        return await client.call_tool(name, arguments, read_timeout_seconds=60, progress_callback=on_progress)
    return step


def timeline(stack: Any, action_id: str) -> list[tuple[int, str]]:
    with stack.conn.cursor() as cur:
        cur.execute("SELECT seq, event FROM ledger_events WHERE action_id = %s ORDER BY seq", (action_id,))
        return [(r["seq"], r["event"]) for r in cur.fetchall()]


@pytest.mark.parametrize("transport", ["http", "stdio"])
def test_a_call_with_a_progress_token_gets_the_ledger_stages_as_they_land(gw: dict[str, Any], transport: str) -> None:
    stack, seen = gw["stack"], []
    session = agent_session if transport == "http" else stdio_session
    [result] = session(gw, "ops", progress_call("ticket.create", create_args(), seen))
    body = result.structured_content
    assert not result.is_error and body["outcome"] == Outcome.completed_verified.value, body
    chain = timeline(stack, body["action_id"])
    # One notification per ledger event, in chain order, up to and including the settlement: the
    # progress is the event's position, the message its name, and no total is claimed.
    assert [(float(seq), None, event) for seq, event in chain[:len(seen)]] == seen
    assert seen[0][2] == "published" and "tool_called" in [m for _, _, m in seen]
    settled_at = next(seq for seq, event in chain if event == "final_state")
    assert seen[-1][0] >= settled_at


# --- MCP Tasks --------------------------------------------------------------------------------------


class TaskAnswer(types.Result):
    """``tools/call`` answered as a task (the Tasks extension's result shape)."""

    result_type: Literal["task"] = Field(alias="resultType")
    task: types.Task


class Tasks(ClientExtension):
    """The client's side of the Tasks extension: a task answer is polled to its result."""

    identifier = TASKS

    def __init__(self) -> None:
        self.polled: list[str] = []

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=TaskAnswer, resolve=self.resolve)]

    async def resolve(self, answer: TaskAnswer, ctx: ClaimContext) -> types.CallToolResult:
        task_id = answer.task.task_id
        while True:
            task = await get_task(ctx.session, task_id)
            self.polled.append(task.status)
            if task.status in ("completed", "failed", "cancelled"):
                return await task_result(ctx.session, task_id)
            await anyio.sleep((task.poll_interval or 500) / 1000)


async def get_task(session: Any, task_id: str) -> types.GetTaskResult:
    return await session.send_request(types.GetTaskRequest(params=types.GetTaskRequestParams(task_id=task_id)),
                                      types.GetTaskResult, request_read_timeout_seconds=30)


async def task_result(session: Any, task_id: str) -> types.CallToolResult:
    return await session.send_request(
        types.GetTaskPayloadRequest(params=types.GetTaskPayloadRequestParams(task_id=task_id)), types.CallToolResult,
        request_read_timeout_seconds=60)


def tasks_session(gw: dict[str, Any], agent: str, extension: Tasks, *steps: Any) -> list[Any]:
    async def go() -> list[Any]:
        headers = {"Authorization": f"Bearer {gw['tokens'][agent]}"}
        async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(60.0)) as http:
            async with Client(streamable_http_client(gw["url"], http_client=http), extensions=[extension]) as client:
                return [await step(client) for step in steps]

    return anyio.run(go)


def test_a_client_declaring_tasks_gets_a_task_it_polls_to_the_proven_outcome(gw: dict[str, Any]) -> None:
    tasks = Tasks()

    async def capabilities(client: Client) -> Any:
        return client.server_capabilities

    caps, result = tasks_session(gw, "ops", tasks, capabilities, call("ticket.create", create_args()))
    assert TASKS in (caps.extensions or {})
    # The SDK's client resolved the task through the extension: polled, then its result fetched.
    body = result.structured_content
    assert not result.is_error and body["outcome"] == Outcome.completed_verified.value, body
    assert tasks.polled[-1] == "completed" and set(tasks.polled) <= {"working", "completed"}
    assert result.meta["io.modelcontextprotocol/related-task"]["taskId"] == body["action_id"]
    assert gw["stack"].action(body["action_id"]).outcome == Outcome.completed_verified


def test_a_proposal_is_a_working_task_until_approved_then_completed(gw: dict[str, Any]) -> None:
    stack = gw["stack"]
    ticket = sor.put_ticket(stack.sor_db, "acme", f"to close {uid()}", "ops")
    version = sor.get_ticket(stack.sor_db, ticket)["ticket"]["version"]
    args = {"target": {"id": ticket, "expected_version": version},
            "arguments": {"ticket_id": ticket, "expected_version": version}}

    async def propose(client: Client) -> TaskAnswer:
        answer = await client.session.call_tool("ticket.close", args, read_timeout_seconds=60, allow_claimed=True)
        assert isinstance(answer, TaskAnswer), answer
        return answer

    [answer] = tasks_session(gw, "ops", Tasks(), propose)
    task_id = answer.task.task_id
    # Answered once published: the worker has yet to find that the policy makes it a proposal.
    assert task_id.startswith("gw-ops-") and answer.task.status == "working"
    assert answer.task.ttl is None and answer.task.poll_interval
    wait_for(lambda: stack.action(task_id).status == ActionStatus.proposed, 30, what="the proposal")

    async def get(client: Client) -> types.GetTaskResult:
        return await get_task(client.session, task_id)

    # Polling is stateless: a new session (any gateway process) answers for the task.
    [working] = tasks_session(gw, "ops", Tasks(), get)
    assert (working.status, working.status_message) == ("working", "proposed: waiting for an approver's decision")

    async def other(client: Client) -> str:
        with pytest.raises(MCPError) as refused:
            await get_task(client.session, task_id)
        return str(refused.value.error.code)

    assert tasks_session(gw, "beta", Tasks(), other) == ["-32602"]  # another agent's task is unknown
    proposals.approve(gw["settings"], stack.operator, CeleryDispatch(stack.app), task_id, gw["alice"])

    async def poll_to_result(client: Client) -> tuple[list[str], types.CallToolResult]:
        statuses: list[str] = []
        while not statuses or statuses[-1] == "working":
            statuses.append((await get_task(client.session, task_id)).status)
            await anyio.sleep(0.2)
        return statuses, await task_result(client.session, task_id)

    [(statuses, result)] = tasks_session(gw, "ops", Tasks(), poll_to_result)
    assert statuses[-1] == "completed", statuses
    assert result.structured_content["outcome"] == Outcome.completed_verified.value
    assert result.meta["io.modelcontextprotocol/related-task"] == {"taskId": task_id}
    assert sor.get_ticket(stack.sor_db, ticket)["ticket"]["status"] == "closed"


def test_a_2025_11_25_client_gets_a_task_for_a_task_augmented_call(gw: dict[str, Any]) -> None:
    async def go() -> tuple[Any, Any, Any]:
        async with Client(stdio_params(gw, gw["tokens"]["ops"]), mode="legacy", read_timeout_seconds=60) as client:
            caps = client.server_capabilities
            created = await _send_call(client, "ticket.create", create_args(), {}, 60_000, 60)
            task_id = created.task.task_id
            while (task := await get_task(client.session, task_id)).status == "working":
                await anyio.sleep(0.2)
            return caps, task, await task_result(client.session, task_id)

    caps, task, result = anyio.run(go)
    assert caps.tasks is not None and caps.tasks.requests.tools.call is not None
    assert task.status == "completed" and task.task_id.startswith("gw-ops-")
    assert result.structured_content["action_id"] == task.task_id
    assert result.structured_content["outcome"] == Outcome.completed_verified.value


def test_over_stdio_an_agent_removed_from_the_agents_file_is_refused_from_its_next_request(
        gw: dict[str, Any], tmp_path: Any) -> None:
    token, digest = new_token()
    agents = tmp_path / "agents.yaml"
    spec = {"token_sha256": digest, "workload_identity": "agent:temp-bot", "requester": "dana@acme.test",
            "tenant": "acme", "action_types": ["ticket.create"]}
    agents.write_text(yaml.safe_dump({"agents": {"temp": spec}}))
    params = stdio_params({**gw, "agents": agents}, token)

    async def go() -> tuple[list[str], int]:
        async with Client(params, read_timeout_seconds=60) as client:
            before = await list_tools(client)
            agents.write_text(yaml.safe_dump({"agents": {}}))
            with pytest.raises(MCPError) as refused:
                await client.call_tool("ticket.create", create_args(), read_timeout_seconds=60)
            assert "agents file" in refused.value.error.message
            return before, refused.value.error.code

    before, code = anyio.run(go)
    assert before == ["proofline_action_status", "ticket.create"] and code == types.INVALID_REQUEST


# --- read tools -------------------------------------------------------------------------------------


def test_a_contract_read_is_listed_read_only_and_answers_the_current_value(gw: dict[str, Any]) -> None:
    stack = gw["stack"]
    ticket = sor.put_ticket(stack.sor_db, "acme", f"to read {uid()}", "ops")

    async def read_tool(client: Client) -> types.Tool:
        return next(t for t in (await client.list_tools()).tools if t.name == "ticket.close.read")

    tool, first = agent_session(gw, "ops", read_tool, call("ticket.close.read", {"target": {"id": ticket}}))
    assert tool.annotations.read_only_hint is True and tool.annotations.destructive_hint is False
    assert tool.input_schema["required"] == ["target"] and "execution" not in tool.model_dump(exclude_none=True)
    body = first.structured_content
    assert not first.is_error, body
    assert body["value"]["ticket"]["id"] == ticket and body["value"]["ticket"]["status"] == "open"
    # The system of record's value now: changed behind the gateway's back, the next read shows it.
    sor.close_ticket(stack.sor_db, ticket, body["value"]["ticket"]["version"])
    [second] = agent_session(gw, "ops", call("ticket.close.read", {"target": {"id": ticket}}))
    assert second.structured_content["value"]["ticket"]["status"] == "closed"
    assert second.structured_content["value"]["ticket"]["version"] == body["value"]["ticket"]["version"] + 1
    # Each read is recorded on its own chain: who asked, which contract, which target, which MCP request.
    with stack.conn.cursor() as cur:
        state = read_store.state(cur, body["request_id"])
    request = state["request"]
    assert (request["agent"], request["tenant"], request["workload_identity"]) == ("ops", "acme", "agent:ops-bot")
    assert (request["action_type"], request["target"]) == ("ticket.close", {"type": "ticket", "id": ticket})
    assert request["mcp_request_id"] and state["answer"]["found"] is True
    assert timeline(stack, f"read:{body['request_id']}") == [(1, "read_requested"), (2, "read_answered")]


def test_a_read_of_another_tenants_target_is_refused(gw: dict[str, Any]) -> None:
    stack = gw["stack"]
    theirs = sor.put_ticket(stack.sor_db, "beta", f"beta's {uid()}", "ops")
    [other, missing] = agent_session(gw, "ops", call("ticket.close.read", {"target": {"id": theirs}}),
                                     call("ticket.close.read", {"target": {"id": f"no-such-{uid()}"}}))
    assert other.is_error and other.structured_content["refused"] == "target_not_found", other.structured_content
    assert "value" not in other.structured_content and "beta" not in json.dumps(other.structured_content)
    # Another tenant's target and a missing one answer the same: a read tells no tenant what another has.
    assert missing.is_error and missing.structured_content["refused"] == "target_not_found"
    with stack.conn.cursor() as cur:
        answer = read_store.state(cur, other.structured_content["request_id"])["answer"]
    assert answer == {"found": False, "refused": "target_not_found", "signed_by": answer["signed_by"]}
    # An agent without the action type has no read tool, and calling one is refused before anything.
    [listed] = agent_session(gw, "beta", list_tools)
    assert "ticket.close.read" not in listed
    [denied] = agent_session(gw, "beta", call("ticket.close.read", {"target": {"id": theirs}}))
    assert denied.is_error and denied.structured_content["refused"] == "action_type_not_permitted"


def test_a_forged_or_unsigned_read_task_is_refused_by_the_worker(gw: dict[str, Any], tmp_path: Any) -> None:
    stack = gw["stack"]
    ticket = sor.put_ticket(stack.sor_db, "acme", f"forged {uid()}", "ops")
    request = {"request_id": uid(), "agent": "ops", "workload_identity": "agent:ops-bot", "requester": "dana@acme.test",
               "tenant": "acme", "action_type": "ticket.close", "contract_version": 1, "contract_digest": "",
               "target": {"type": "ticket", "id": ticket}, "mcp_request_id": "1"}
    with ledger_store.transaction(stack.conn) as cur:  # recorded as the controller role records it
        read_store.request_txn(cur, request, "gateway:ops")
    controller = load_signing_key(stack.settings.signing_key_file, KeyRole.controller)
    signed = sign_request(request, controller)
    # The controller role cannot answer a read, whatever it signs.
    with pytest.raises(Exception, match="not allowed"):
        with ledger_store.transaction(stack.conn) as cur:
            read_store.answer_txn(cur, request["request_id"], {"found": True, "value": {"forged": True}}, "gateway")
    add_approver(stack.settings.keyring_file, tmp_path / "mallory.key", "mallory@example.com", development=True)
    mallory = load_signing_key(tmp_path / "mallory.key", KeyRole.approver)
    log = stack.workdir / "worker-w0.log"
    before = log.read_text().count("read task refused")
    dispatch = CeleryDispatch(stack.app)
    forged = [
        {"request": request},                                                          # unsigned
        {**signed, "request": {**request, "tenant": "beta"}},                          # tampered: another tenant
        {**signed, "signature": sign_request({**request, "request_id": uid()}, controller)["signature"]},
        {"request": request, "key_id": mallory.key_id,                                 # not a controller key
         "signature": signed["signature"]},
        sign_request({**request, "target": {"type": "ticket", "id": "other"}}, controller),  # never recorded
    ]
    for message in forged:
        dispatch.read(message, "acme")
    wait_for(lambda: log.read_text().count("read task refused") >= before + len(forged), 60,
             what="the worker to refuse every forged read task")
    with stack.conn.cursor() as cur:
        assert read_store.state(cur, request["request_id"])["answer"] is None
    # The request signed as recorded is answered: the worker was there all along, refusing.
    dispatch.read(signed, "acme")

    def answered() -> Any:
        with stack.conn.cursor() as cur:
            return read_store.state(cur, request["request_id"])["answer"]

    wait_for(answered, 60, what="the signed read to be answered")
    assert answered()["found"] is True and answered()["value"]["ticket"]["id"] == ticket
    assert timeline(stack, f"read:{request['request_id']}") == [(1, "read_requested"), (2, "read_answered")]


def test_a_read_whose_ids_look_like_card_numbers_is_answered_and_its_record_stays_masked(gw: dict[str, Any]) -> None:
    # The ledger masks whatever looks like a card number in every event it stores, the recorded
    # request included; the worker still knows it for the request that was signed (by its digest)
    # instead of refusing it as not recorded. A request id made of 13 digits passes the card check
    # about one time in ten: a test's ids once did, and its signed read was refused.
    stack = gw["stack"]
    stem = "4" + uid()[-11:].rjust(11, "0")
    request_id = next(stem + d for d in "0123456789" if scrub_text(stem + d) != stem + d)  # the ledger masks it
    card_like = "4111111111111111"
    request = {"request_id": request_id, "agent": "ops", "workload_identity": "agent:ops-bot",
               "requester": "dana@acme.test", "tenant": "acme", "action_type": "ticket.close", "contract_version": 1,
               "contract_digest": "", "target": {"type": "ticket", "id": card_like}, "mcp_request_id": request_id}
    with ledger_store.transaction(stack.conn) as cur:
        read_store.request_txn(cur, request, "gateway:ops")
    with stack.conn.cursor() as cur:
        stored = read_store.state(cur, request_id)["request"]
    assert stored["target"]["id"] != card_like and stored["request_id"] != request_id, stored  # masked
    assert stored[read_store.DIGEST_KEY] == read_store.request_digest(request)
    controller = load_signing_key(stack.settings.signing_key_file, KeyRole.controller)
    CeleryDispatch(stack.app).read(sign_request(request, controller), "acme")

    def answered() -> Any:
        with stack.conn.cursor() as cur:
            return read_store.state(cur, request_id)["answer"]

    answer = wait_for(answered, 60, what="the read with card-like ids to be answered")
    assert answer["found"] is False and answer["refused"] == "target_not_found", answer
