"""``proofline gateway``: an MCP server (streamable HTTP, or stdio) in front of the controller path.

Each ``tools/call`` of a governed tool becomes an envelope signed with the gateway's controller key
(the authority policy then decides its mode, exactly as for any controller): the agent's credential
names the workload identity, the accountable requester and the tenant, whatever the arguments say.
The gateway waits for the outcome (``PROOFLINE_GATEWAY_WAIT_SECONDS``) and answers with it; a
proposal, or an action still being verified, answers with its action id for
``proofline_action_status``. The agent's MCP request id is recorded in the envelope's request
context (``approval.id``: ``gateway:<agent>:mcp-request:<id>``), so the ledger ties the action to the
request that asked for it. An agent that sets ``_meta["proofline/idempotency_key"]`` gets the same
action id for the same key, so a call retried after a lost answer is the action it already asked for.

Every request is authenticated twice: an HTTP middleware refuses a missing or unknown bearer token
with 401 before MCP sees it, and each handler maps the token to its agent again (the tool list is
the agent's, not the server's). Over stdio the token is the process's (``PROOFLINE_GATEWAY_TOKEN``),
mapped to its agent on each request in the same way.

A call with a ``progressToken`` streams the action's ledger events as progress
(``proofline/gateway/progress.py``); a client that declares Tasks gets the action as an MCP Task
(``proofline/gateway/tasks.py``). ``<action type>.read`` tools answer a contract's read of one target
through a worker (``proofline/gateway/reads.py``).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from mcp import types
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ledger import store
from proofline.client import ActionResult, Client
from proofline.errors import ProoflineError, WaitTimedOut
from proofline.gateway import progress, tools
from proofline.gateway import tasks as gateway_tasks
from proofline.gateway.agents import Agent, agent_slug, authenticate, load_agents
from proofline.gateway.reads import Reader, read_tool
from proofline.reads import SUFFIX as READ_SUFFIX
from proofline.settings import Settings

log = logging.getLogger(__name__)
#: ``_meta`` key an agent may set so that a retried call is the same action (published once).
IDEMPOTENCY_META_KEY = "proofline/idempotency_key"


class Gateway:
    """The gateway's state: settings, the agents file, one controller client per thread.

    ``token`` is set for the stdio transport: the process serves the one agent whose token its
    environment carries (``PROOFLINE_GATEWAY_TOKEN``), looked up in the agents file again on each
    request, so an agent revoked from the file is refused without a restart."""

    def __init__(self, settings: Settings, agents_file: Path, wait_seconds: float, console_url: str | None,
                 token: str | None = None) -> None:
        self.settings = settings
        self.agents_file = agents_file
        self.wait_seconds = wait_seconds
        self.console_url = console_url
        self.token = token
        self.reader = Reader(settings, wait_seconds)
        # One controller client per worker thread: a client holds one connection and one listener.
        self._local = threading.local()

    @property
    def client(self) -> Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = Client(self.settings)
        return client

    def agent(self, ctx: Any) -> Agent:
        if self.token is not None:
            header: str | None = f"Bearer {self.token}"
        else:
            request = getattr(ctx, "request", None)
            header = request.headers.get("authorization") if request is not None else None
        agent = authenticate(load_agents(self.agents_file), header)
        if agent is None:
            # Over HTTP the middleware refused it already (a handler never trusts that alone); over
            # stdio this is an agent removed from the agents file since the process started.
            raise MCPError(types.INVALID_REQUEST, "no valid gateway credential: the token is not in the agents file")
        return agent

    async def list_tools(self, ctx: Any, params: Any) -> types.ListToolsResult:
        agent = self.agent(ctx)
        listed = [tools.status_tool()]
        for action_type in agent.action_types:
            try:
                listed.append(tools.governed_tool(self.settings, action_type)[0])
                read = read_tool(self.settings, action_type)
                if read is not None:  # the contract's own read of one target, for the agent's tenant
                    listed.append(read)
            except ProoflineError as exc:  # an action type it cannot serve now is not offered
                log.warning("gateway tool not offered", extra={"event": "gateway_tool_unavailable",
                                                               "action_type": action_type, "reason_code": exc.code})
        return types.ListToolsResult(tools=listed)

    async def call_tool(self, ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        agent = self.agent(ctx)
        args = dict(params.arguments or {})
        meta = params.meta if isinstance(params.meta, dict) else (
            params.meta.model_dump() if params.meta is not None else {})
        key = meta.get(IDEMPOTENCY_META_KEY)
        if params.name == tools.STATUS_TOOL:
            return await anyio.to_thread.run_sync(self._status, agent, str(args.get("action_id", "")))
        if params.name.endswith(READ_SUFFIX) and params.name[:-len(READ_SUFFIX)] in agent.action_types:
            return await anyio.to_thread.run_sync(self._contract_read, agent, params.name[:-len(READ_SUFFIX)], args,
                                                  ctx.request_id)
        if params.name not in agent.action_types:
            return tools.refusal("action_type_not_permitted", f"{params.name!r} is not an action this agent may use")
        published = await anyio.to_thread.run_sync(self._publish, agent, params.name, args, ctx.request_id,
                                                   key if isinstance(key, str) and key else None)
        if isinstance(published, types.CallToolResult):
            return published
        task = gateway_tasks.wanted()
        if task is not None:  # answered as a task: the middleware sends it, the agent polls
            task["task"] = gateway_tasks.task_of(await anyio.to_thread.run_sync(self._row, published))
            return types.CallToolResult(content=[])
        if progress.progress_token(params) is not None:
            async def report(seq: float, event: str) -> None:
                await ctx.session.report_progress(seq, None, event)

            result = await progress.follow(lambda after: self._read(published, after), report, self.wait_seconds)
        else:
            result = await anyio.to_thread.run_sync(self._wait, published)
        return tools.outcome_result(result, self.console_url)

    def _status(self, agent: Agent, action_id: str) -> types.CallToolResult:
        if not self._owns(agent, action_id):  # another agent's action is as unknown as a missing one
            return tools.refusal("unknown_action", f"no action {action_id!r} of this agent")
        try:
            return tools.outcome_result(self.client.status(action_id), self.console_url)
        except KeyError:
            return tools.refusal("unknown_action", f"no action {action_id!r} of this agent")

    def _contract_read(self, agent: Agent, action_type: str, args: dict[str, Any], request_id: Any
                       ) -> types.CallToolResult:
        try:
            return self.reader.read(agent, action_type, args, request_id)
        except ProoflineError as exc:  # nothing was asked of a worker, or it could not be recorded
            return tools.refusal(exc.code, exc.detail[:500])

    def _owns(self, agent: Agent, action_id: str) -> bool:
        return action_id.startswith(f"gw-{agent_slug(agent.name)}-")

    def _publish(self, agent: Agent, action_type: str, args: dict[str, Any], request_id: Any,
                 key: str | None) -> str | types.CallToolResult:
        """Publish the call as an action: its id, or the refusal (nothing was published)."""
        _, contract = tools.governed_tool(self.settings, action_type)
        arguments, target = args.get("arguments"), args.get("target")
        if not isinstance(arguments, dict) or not isinstance(target, dict) or not target.get("id"):
            return tools.refusal("arguments_invalid", "give 'target' with an 'id' and 'arguments' as objects")
        # The credential's tenant is the action's: an argument naming another one is refused outright.
        named = arguments.get("tenant")
        if named is not None and named != agent.tenant:
            return tools.refusal("tenant_mismatch", f"this agent acts for tenant {agent.tenant!r}, not {named!r}")
        action_id = _action_id(agent, key)
        try:
            self.client.publish(
                action_type, arguments=arguments, target={"type": contract.target_type, **target},
                tenant=agent.tenant, action_id=action_id, run_id=f"run-{action_id}", requester=agent.requester,
                workload_identity=agent.workload_identity,
                approval_id=f"gateway:{agent.name}:mcp-request:{request_id}"[:200])
        except ProoflineError as exc:
            return tools.refusal(exc.code, exc.detail[:500])
        return action_id

    def _wait(self, action_id: str) -> ActionResult:
        try:
            return self.client.wait(action_id, self.wait_seconds)
        except WaitTimedOut:
            return self.client.status(action_id)  # still running: the agent asks again by its id

    def _read(self, action_id: str, after_seq: int) -> tuple[ActionResult, list[dict[str, Any]]]:
        # The state first, then the events: a settled state's own events are already committed.
        result = self.client.status(action_id)
        return result, self.client.events(action_id, after_seq, progress.BATCH)

    def _row(self, action_id: str) -> store.ActionRow:
        return self.client.row(action_id)

    # --- MCP Tasks (proofline/gateway/tasks.py) ------------------------------------------------
    def _own_row(self, ctx: Any, task_id: str) -> store.ActionRow:
        if not self._owns(self.agent(ctx), task_id):
            raise gateway_tasks.unknown(task_id)
        try:
            return self.client.row(task_id)
        except KeyError:
            raise gateway_tasks.unknown(task_id) from None

    async def get_task(self, ctx: Any, params: types.GetTaskRequestParams) -> dict[str, Any]:
        row = await anyio.to_thread.run_sync(self._own_row, ctx, params.task_id)
        return gateway_tasks.task_of(row)

    async def task_result(self, ctx: Any, params: types.GetTaskPayloadRequestParams) -> dict[str, Any]:
        deadline = anyio.current_time() + self.wait_seconds
        while True:
            row = await anyio.to_thread.run_sync(self._own_row, ctx, params.task_id)
            if gateway_tasks.terminal(row):
                break
            if anyio.current_time() >= deadline:
                raise MCPError(gateway_tasks.UNKNOWN_TASK, f"task {params.task_id!r} is still working "
                               f"({row.status.value}): ask tasks/get, then tasks/result again")
            await anyio.sleep(progress.POLL_SECONDS * 2)
        answer = tools.outcome_result(ActionResult.of(row), self.console_url)
        return gateway_tasks.related(answer.model_dump(by_alias=True, mode="json", exclude_none=True),
                                     params.task_id)


def _action_id(agent: Agent, key: str | None) -> str:
    """The action's id: derived from the agent's idempotency key when it gives one (a retried call is
    the same action, published once), else new for every call."""
    tail = hashlib.sha256(f"{agent.name}\0{key}".encode()).hexdigest()[:32] if key else uuid.uuid4().hex
    return f"gw-{agent_slug(agent.name)}-{tail}"


class BearerOnly:
    """Refuses any HTTP request without a known bearer token (401, with the scheme named)."""

    def __init__(self, app: ASGIApp, agents: Callable[[], dict[str, Agent]]) -> None:
        self.app, self.agents = app, agents

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if authenticate(self.agents(), header) is None:
                response = JSONResponse({"error": "unauthorized", "message": "a gateway bearer token is required"},
                                        status_code=401, headers={"WWW-Authenticate": 'Bearer realm="proofline"'})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class GatewayServer(Server[Any]):
    """The low-level MCP server, with the Tasks capability the SDK cannot declare itself."""

    def get_capabilities(self, *args: Any, **kwargs: Any) -> types.ServerCapabilities:
        return gateway_tasks.capabilities(super().get_capabilities(*args, **kwargs))


def build_server(gateway: Gateway) -> Server[Any]:
    """The MCP server of the gateway, for either transport."""
    from importlib.metadata import version

    server = GatewayServer("proofline-gateway", version=version("proofline"), on_list_tools=gateway.list_tools,
                           on_call_tool=gateway.call_tool,
                           instructions="Each tool is a governed action: its answer is the proven outcome.")
    server.add_request_handler("tasks/get", types.GetTaskRequestParams, gateway.get_task)
    server.add_request_handler("tasks/result", types.GetTaskPayloadRequestParams, gateway.task_result)
    server.extensions[gateway_tasks.IDENTIFIER] = {}
    server.middleware.append(gateway_tasks.middleware)
    return server


def build_app(gateway: Gateway, host: str) -> ASGIApp:
    """The ASGI app: the MCP endpoint at ``/mcp`` behind the bearer check. Responses are event
    streams (not single JSON bodies) so that a call's progress notifications reach the agent."""
    app = build_server(gateway).streamable_http_app(stateless_http=True, json_response=False, host=host)
    return BearerOnly(app, lambda: load_agents(gateway.agents_file))


async def serve_stdio(gateway: Gateway) -> None:
    """Serve the gateway on this process's stdin and stdout until stdin closes."""
    from mcp.server.stdio import stdio_server

    server = build_server(gateway)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())
