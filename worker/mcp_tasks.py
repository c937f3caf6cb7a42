"""The write call as an MCP Task: create it, record its id, poll it, retrieve its result.

A contract that names ``mcp_task`` runs its call as a task when the live server advertises Tasks
(``capabilities.tasks.requests.tools.call`` on 2025-11-25; the ``io.modelcontextprotocol/tasks``
extension on 2026-07-28, where the core capability and ``execution.taskSupport`` are gone from the
wire). The ``tools/call`` carries ``task: {ttl}`` and answers a ``CreateTaskResult``; its task id is
committed to the ledger at once (``mcp_task_created``) so that a redelivery, on this worker or
another, polls the same task instead of calling again (``mcp_task_resumed``). ``tasks/get`` is polled
at the server's ``pollInterval`` (within the contract's bounds) until the task is terminal, and never
past the envelope's absolute deadline; ``tasks/result`` gives the ``CallToolResult`` the classifier
reads like any other. The statuses seen are counted and kept up to the progress bound.

An operator's cancellation cuts the polling (the heartbeat's ``on_cancel``) and sends
``tasks/cancel`` (``mcp_task_cancel_sent``); the call is then ``cancelled_in_flight`` and
verification decides. A task the server no longer knows, one past its time to live, and one that
ended without a result raise :class:`McpTaskExpired`: unknown outcome, settled by verification.

The SDK (2.3.0) has the Tasks types and no client for them: its ``tools/call`` validates the answer
as a ``CallToolResult``, so the task-augmented call goes out through the session's own stamp and
dispatcher (:func:`_send_call`); ``tasks/get``, ``tasks/result`` and ``tasks/cancel`` go through
``session.send_request`` with the SDK's request and result models.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp.types import (
    CallToolResult,
    CancelTaskRequest,
    CancelTaskRequestParams,
    CancelTaskResult,
    CreateTaskResult,
    GetTaskPayloadRequest,
    GetTaskPayloadRequestParams,
    GetTaskRequest,
    GetTaskRequestParams,
    GetTaskResult,
)

from ledger import store
from proofline.contracts import McpTask
from proofline.errors import AbsoluteDeadlineReached, McpTaskExpired
from worker import calls, faultpoints
from worker.runtime import Runtime
from worker.servers import Server

EXTENSION = "io.modelcontextprotocol/tasks"
TERMINAL = ("completed", "failed", "cancelled")
#: The JSON-RPC error a server answers for a task id it does not know (never made, or expired).
UNKNOWN_TASK = -32602
#: How long a ``tasks/cancel`` may take: it is sent after the call was already cut.
CANCEL_TIMEOUT_SECONDS = 5.0

PENDING_SQL = """
SELECT e.evidence FROM ledger_events e
 WHERE e.action_id = %s AND e.event = 'mcp_task_created'
   AND NOT EXISTS (SELECT 1 FROM ledger_events t WHERE t.action_id = e.action_id AND t.id > e.id
                                                   AND t.event = 'tool_called')
 ORDER BY e.id DESC LIMIT 1"""


def advertised(capabilities: dict[str, Any]) -> bool:
    """Whether the server's declared capabilities say it runs ``tools/call`` as tasks."""
    core = ((capabilities.get("tasks") or {}).get("requests") or {}).get("tools") or {}
    return "call" in core or EXTENSION in (capabilities.get("extensions") or {})


@dataclass
class TaskLog:
    """What the call's evidence records of its task (``mcp_task`` on ``tool_called``)."""

    limit: int
    task_id: str | None = None
    resumed: bool = False
    created: dict[str, Any] = field(default_factory=dict)
    statuses: list[dict[str, Any]] = field(default_factory=list)
    status_total: int = 0
    polls: dict[str, Any] = field(default_factory=dict)
    result_request: dict[str, Any] = field(default_factory=dict)
    cancel: dict[str, Any] | None = None
    final_status: str | None = None

    def saw(self, task: Any) -> None:
        self.status_total += 1
        entry = {"status": task.status, "message": (task.status_message or "")[:200]}
        if len(self.statuses) < self.limit and (not self.statuses or self.statuses[-1] != entry):
            self.statuses.append(entry)
        self.final_status = task.status

    def evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {"task_id": self.task_id, "resumed": self.resumed, "status_total": self.status_total,
                               "statuses": list(self.statuses), "final_status": self.final_status}
        for name, value in (("created", self.created), ("polls", self.polls), ("result_request", self.result_request),
                            ("cancel", self.cancel)):
            if value:
                out[name] = value
        return out


def pending_task_txn(cur: Any, action_id: str) -> dict[str, Any] | None:
    """The task an earlier delivery of this action created and no call result has closed."""
    cur.execute(PENDING_SQL, (action_id,))
    row = cur.fetchone()
    return dict(row["evidence"]) if row is not None else None


def pending_task(conn: Any, action_id: str) -> dict[str, Any] | None:
    with conn.cursor() as cur:
        return pending_task_txn(cur, action_id)


async def _send_call(client: Client, tool: str, arguments: dict[str, Any], meta: dict[str, Any], ttl_ms: int,
                     timeout: float) -> CreateTaskResult:
    session = client.session
    data: dict[str, Any] = {"method": "tools/call", "params": {"name": tool, "arguments": arguments,
                                                               "task": {"ttl": ttl_ms}, "_meta": meta}}
    opts: dict[str, Any] = {"timeout": timeout}
    session._stamp(data, opts)  # the protocol envelope the SDK adds to every request it sends
    raw = await session._dispatcher.send_raw_request("tools/call", data["params"], opts)
    return CreateTaskResult.model_validate({k: v for k, v in raw.items() if k != "resultType"}, by_name=False)


async def _poll(client: Client, task_id: str, policy: McpTask, log: TaskLog, timeout: float,
                deadline_monotonic: float, expires_at: float | None) -> str:
    session = client.session
    while True:
        try:
            task = await session.send_request(GetTaskRequest(params=GetTaskRequestParams(task_id=task_id)),
                                              GetTaskResult, request_read_timeout_seconds=timeout)
        except MCPError as exc:
            if exc.code == UNKNOWN_TASK:
                raise McpTaskExpired(f"the server no longer knows task {task_id}: {exc.error.message[:200]}",
                                     task_id=task_id) from exc
            raise
        log.saw(task)
        if task.status in TERMINAL:
            return task.status
        now = time.monotonic()
        if expires_at is not None and time.time() > expires_at:
            raise McpTaskExpired(f"task {task_id} is past its time to live and still {task.status}", task_id=task_id)
        wait = min(max((task.poll_interval or 0) / 1000, policy.min_poll_seconds), policy.max_poll_seconds)
        if now + wait >= deadline_monotonic:
            raise AbsoluteDeadlineReached(f"task {task_id} still {task.status} at the absolute deadline",
                                          progress_notifications=log.status_total)
        await anyio.sleep(wait)


async def _result(client: Client, task_id: str, timeout: float) -> CallToolResult:
    try:
        return await client.session.send_request(
            GetTaskPayloadRequest(params=GetTaskPayloadRequestParams(task_id=task_id)), CallToolResult,
            request_read_timeout_seconds=timeout)
    except MCPError as exc:
        if exc.code == UNKNOWN_TASK:
            raise McpTaskExpired(f"task {task_id} has no result to retrieve: {exc.error.message[:200]}",
                                 task_id=task_id) from exc
        raise


async def _cancel(client: Client, task_id: str) -> str:
    result = await client.session.send_request(CancelTaskRequest(params=CancelTaskRequestParams(task_id=task_id)),
                                               CancelTaskResult, request_read_timeout_seconds=CANCEL_TIMEOUT_SECONDS)
    return result.status


def _record(rt: Runtime, action_id: str, event: str, evidence: dict[str, Any]) -> None:
    with store.transaction(rt.conn) as cur:
        store.append_event_txn(cur, action_id, event, rt.settings.worker_id, evidence)


def call(rt: Runtime, server: Server, *, action_id: str, tool: str, arguments: dict[str, Any],
         meta: dict[str, Any], policy: McpTask, timeout: float, deadline_monotonic: float, log: TaskLog,
         cancel_handle: Any) -> tuple[CallToolResult, float, dict[str, Any]]:
    """Run the call as a task (or go on polling the one an earlier delivery created). Returns the
    result, the seconds taken and the ``tools/call``'s request ids (empty when resumed)."""
    started = time.monotonic()
    call_request: dict[str, Any] = {}
    earlier = pending_task(rt.conn, action_id)
    if earlier is not None:
        log.task_id, log.resumed, log.created = earlier["task_id"], True, earlier
        expires_at = earlier.get("expires_at")
        _record(rt, action_id, "mcp_task_resumed", {"task_id": log.task_id})
    else:
        created = rt.mcp.run(server, "write", lambda c: _send_call(  # type: ignore[arg-type]
            c, tool, arguments, meta, int(policy.ttl_seconds * 1000), timeout))
        call_request = rt.mcp.last_request
        task = created.task
        expires_at = time.time() + task.ttl / 1000 if task.ttl is not None else None
        log.task_id = task.task_id
        log.created = {"task_id": task.task_id, "status": task.status, "ttl_ms": task.ttl,
                       "poll_interval_ms": task.poll_interval, "expires_at": expires_at, **call_request}
        log.saw(task)
        # Committed before polling: whoever runs this action next resumes this task, never re-sends.
        _record(rt, action_id, "mcp_task_created", log.created)
        faultpoints.hit("after_task_created", action_id)
    task_id = log.task_id
    assert task_id is not None
    try:
        try:
            status = rt.mcp.run(server, "write", lambda c: _poll(  # type: ignore[arg-type]
                c, task_id, policy, log, timeout, deadline_monotonic, expires_at), cancel_handle=cancel_handle)
        finally:
            log.polls = rt.mcp.last_request
        if status == "cancelled":
            raise McpTaskExpired(f"task {task_id} was cancelled by the server: it has no result", task_id=task_id,
                                 status=status)
        try:
            result = rt.mcp.run(server, "write", lambda c: _result(c, task_id, timeout))  # type: ignore[arg-type]
        finally:
            log.result_request = rt.mcp.last_request
    except McpTaskExpired as exc:
        # The expiry is a fact of its own in the ledger, as an expired operation record is.
        _record(rt, action_id, "mcp_task_expired", {**exc.as_evidence(), "last_status": log.final_status})
        raise
    except BaseException:
        if cancel_handle is not None and cancel_handle.requested:
            _send_cancel(rt, server, action_id, log)
        raise
    return result, time.monotonic() - started, call_request


def _send_cancel(rt: Runtime, server: Server, action_id: str, log: TaskLog) -> None:
    """``tasks/cancel`` for a cancelled action; what the server answered is recorded, never raised."""
    assert log.task_id is not None
    try:
        status = rt.mcp.run(server, "write", lambda c: _cancel(c, log.task_id))  # type: ignore[arg-type, arg-type]
        outcome: dict[str, Any] = {"status": status}
    except BaseException as exc:  # noqa: BLE001 - evidence only: the verification read decides
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        outcome = {"error": repr(exc)[:300]}
    log.cancel = {"task_id": log.task_id, **outcome, **rt.mcp.last_request}
    _record(rt, action_id, "mcp_task_cancel_sent", log.cancel)


def meta_for(idempotency_key: str, action_id: str, token: int, trace_meta: dict[str, str] | None) -> dict[str, Any]:
    return {calls.IDEMPOTENCY_META_KEY: idempotency_key, calls.ACTION_META_KEY: action_id,
            calls.FENCING_META_KEY: token, **(trace_meta or {})}
