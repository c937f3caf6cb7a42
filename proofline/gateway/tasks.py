"""MCP Tasks on the gateway: a governed call answered as a task the agent polls.

A client declares Tasks support in one of the two ways its protocol has: on 2025-11-25 the
``tools/call`` carries ``task`` (task-augmented execution, which the gateway advertises as
``capabilities.tasks.requests.tools.call`` and each governed tool as ``execution.taskSupport:
optional``); on 2026-07-28 the client's capabilities name the ``io.modelcontextprotocol/tasks``
extension (which the gateway advertises in its own). Such a call is published as any other and
answered at once with a ``CreateTaskResult`` whose task id **is the action id**: the ledger is the
task's store, so any gateway process answers for any task, across restarts, and no task state
lives in memory. A client that declares nothing gets the plain answer, as before.

- ``tasks/get`` maps the action's state: ``proposed`` and every running state are ``working``
  (the status message says which: ``proposed: waiting for an approver's decision``, ``verifying``);
  closed verified is ``completed``; closed otherwise, or escalated, is ``failed``; cancelled is
  ``cancelled``.
- ``tasks/result`` waits for a terminal state (at most the gateway's ``--wait``, then ``-32602``:
  ask again) and answers the proven outcome, exactly the ``CallToolResult`` a plain call gets.
- ``tasks/cancel`` is not served and ``tasks.cancel`` not advertised: cancelling an action is an
  operator's right (``proofline cancel``, the console), and the gateway holds controller rights only.

The time to live is ``null``: the ledger keeps the action, so the task never expires on the gateway.
Another agent's task is as unknown as a task never created (``-32602``).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from mcp import types
from mcp.shared.exceptions import MCPError
from mcp.types.version import MODERN_PROTOCOL_VERSIONS

from ledger.states import ActionStatus, Outcome
from ledger.store import ActionRow

IDENTIFIER = "io.modelcontextprotocol/tasks"
#: The poll interval the gateway suggests (ms): a ledger read per poll is cheap.
POLL_INTERVAL_MS = 500
#: JSON-RPC invalid params: what the spec has a server answer for a task it does not know.
UNKNOWN_TASK = -32602
PROPOSED_MESSAGE = "proposed: waiting for an approver's decision"
#: Set by the middleware for the one ``tools/call`` it sees declaring Tasks; the handler puts the
#: created task in it and the middleware answers with it.
_CREATED: ContextVar[dict[str, Any] | None] = ContextVar("proofline_gateway_task", default=None)


def declared(ctx: Any) -> bool:
    """Whether this ``tools/call`` asks to be answered as a task."""
    params = ctx.params if isinstance(ctx.params, Mapping) else {}
    if isinstance(params.get("task"), Mapping):
        return True
    if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
        return False
    capabilities = ctx.session.client_capabilities
    return capabilities is not None and IDENTIFIER in (capabilities.extensions or {})


def wanted() -> dict[str, Any] | None:
    """Inside a ``tools/call`` handler: where to put the task when the call asked for one."""
    return _CREATED.get()


async def middleware(ctx: Any, call_next: Any) -> Any:
    """Answer a Tasks-declaring ``tools/call`` with the task its handler created. Middleware: the
    SDK sieves a 2025-11-25 handler's answer as a ``CallToolResult``, which a ``CreateTaskResult`` is
    not; a refusal (nothing published, so no task) goes out as the handler's plain answer."""
    if ctx.method != "tools/call" or ctx.request_id is None or not declared(ctx):
        return await call_next(ctx)
    box: dict[str, Any] = {}
    token = _CREATED.set(box)
    try:
        answer = await call_next(ctx)
    finally:
        _CREATED.reset(token)
    if "task" not in box:
        return answer
    out = {"task": box["task"]}
    return {**out, "resultType": "task"} if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS else out


def task_of(row: ActionRow) -> dict[str, Any]:
    """The action as a task, on the wire (``ttl`` is present and ``null``, as the spec has it)."""
    status, message = _status(row)
    task = types.Task(task_id=row.action_id, status=status, status_message=message,
                      created_at=row.published_at.isoformat(), last_updated_at=row.updated_at.isoformat(),
                      ttl=None, poll_interval=POLL_INTERVAL_MS)
    return task.model_dump(by_alias=True, mode="json")


def terminal(row: ActionRow) -> bool:
    return _status(row)[0] in ("completed", "failed", "cancelled")


def _status(row: ActionRow) -> tuple[str, str]:
    if row.status == ActionStatus.proposed:
        return "working", PROPOSED_MESSAGE
    if row.status == ActionStatus.cancelled:
        return "cancelled", f"cancelled ({row.reason_code or 'cancelled'})"
    if row.status == ActionStatus.closed:
        verified = row.outcome == Outcome.completed_verified
        return ("completed" if verified else "failed"), f"closed: {row.outcome.value if row.outcome else '-'}"
    if row.status == ActionStatus.escalated:
        return "failed", f"escalated: {row.reason_code or 'an operator decides'}"
    return "working", row.status.value


def unknown(task_id: str) -> MCPError:
    return MCPError(UNKNOWN_TASK, f"no task {task_id!r} of this agent")


def related(result: dict[str, Any], task_id: str) -> dict[str, Any]:
    """``tasks/result``'s answer: the outcome, tied to its task as the spec asks."""
    meta = dict(result.get("_meta") or {})
    meta["io.modelcontextprotocol/related-task"] = {"taskId": task_id}
    return {**result, "_meta": meta}


def capabilities(plain: types.ServerCapabilities) -> types.ServerCapabilities:
    """The gateway's capabilities with Tasks for ``tools/call`` (2025-11-25's core capability)."""
    return plain.model_copy(update={"tasks": types.ServerTasksCapability(
        requests=types.ServerTasksRequestsCapability(tools=types.TasksToolsCapability(
            call=types.TasksCallCapability())))})
