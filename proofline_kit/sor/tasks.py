"""MCP Tasks (protocol 2025-11-25, "Tasks"; an extension from 2026-07-28) on the system of record.

Served only by the ``tasks`` tool-contract variant (``SOR_CONTRACT_VARIANT=tasks``): the default
server keeps the tool list and capabilities every pin in the project was reviewed against. Its one
task tool, ``close_ticket_task``, has ``execution.taskSupport: required``; a ``tools/call`` with a
``task`` parameter answers at once with a ``CreateTaskResult`` and the close happens afterwards, as
a real long-running job would. ``tasks/get``, ``tasks/result`` and ``tasks/cancel`` serve the task
until its time to live has passed; after that it is unknown (``-32602``), as the spec allows.

The SDK has the Tasks types but no server support, so this module adds what it lacks: the
capability (``capabilities.tasks``), the tool's ``execution``, the interceptor that turns a
task-augmented call into a task, and the three methods.

Tasks live in the SQLite file, so any writer process serves any task (a worker's stdio server
dies with the worker that spawned it; the next worker's server still knows the task). The work is
due at a fixed time: the process that created the task applies it then, and any process that is
asked about a task past its due time applies it first, claimed by a guarded update so it is applied
once. Faults, armed per tool like every other (``proofline_kit/sor/faults.py``): ``delay`` makes
the work last ``delay_seconds``; ``task_ttl`` grants a time to live of ``delay_seconds``.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import anyio
from mcp.server.extension import Extension, MethodBinding, ToolBinding
from mcp.shared.exceptions import MCPError
from mcp.types import (
    CallToolResult,
    CancelTaskRequestParams,
    CancelTaskResult,
    CreateTaskResult,
    GetTaskPayloadRequestParams,
    GetTaskRequestParams,
    GetTaskResult,
    ServerTasksCapability,
    ServerTasksRequestsCapability,
    Task,
    TasksCallCapability,
    TasksCancelCapability,
    TasksToolsCapability,
    ToolExecution,
)
from mcp.types.version import MODERN_PROTOCOL_VERSIONS

from proofline_kit.sor import store
from proofline_kit.sor.db import connect, writing
from proofline_kit.sor.runtime import IDEMPOTENCY_META_KEY, error_result, structured

VARIANT = "tasks"
TOOL = "close_ticket_task"
IDENTIFIER = "io.modelcontextprotocol/tasks"
#: The longest time to live granted, and the one granted when the request names none (ms).
MAX_TTL_MS = 120_000
POLL_INTERVAL_MS = 150
WORK_SECONDS = float(os.environ.get("SOR_TASK_SECONDS", "0.8"))
INVALID_PARAMS = -32602
METHOD_NOT_FOUND = -32601
TERMINAL = ("completed", "failed", "cancelled")
#: A ``tasks/result`` waits for a working task at most this long before answering an error.
RESULT_WAIT_SECONDS = 30.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS mcp_tasks (
    task_id TEXT PRIMARY KEY, status TEXT NOT NULL, status_message TEXT,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, due_at REAL NOT NULL, ttl_ms INTEGER NOT NULL,
    arguments TEXT NOT NULL, idempotency_key TEXT, applying INTEGER NOT NULL DEFAULT 0, result TEXT
)"""


def init(path: str) -> None:
    with writing(path) as conn:
        conn.execute(SCHEMA)


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat()


def _row(path: str, task_id: str) -> dict[str, Any] | None:
    conn = connect(path, readonly=True)
    try:
        row = conn.execute("SELECT * FROM mcp_tasks WHERE task_id = ?", (task_id,)).fetchone()
    finally:
        conn.close()
    if row is None or time.time() > row["created_at"] + row["ttl_ms"] / 1000:
        return None  # past its time to live a task is gone, whatever became of its work
    return dict(row)


def _task(row: dict[str, Any]) -> dict[str, Any]:
    return {"task_id": row["task_id"], "status": row["status"], "status_message": row["status_message"],
            "created_at": _iso(row["created_at"]), "last_updated_at": _iso(row["updated_at"]),
            "ttl": row["ttl_ms"], "poll_interval": POLL_INTERVAL_MS}


def _known(path: str, task_id: str) -> dict[str, Any]:
    advance(path, task_id)
    row = _row(path, task_id)
    if row is None:
        raise MCPError(INVALID_PARAMS, f"unknown task {task_id!r} (never created, or past its time to live)")
    return row


def create(path: str, arguments: dict[str, Any], key: str | None, requested_ttl: int | None) -> dict[str, Any]:
    ttl_fault = store.take_fault(path, TOOL + ":ttl")
    delay = store.take_fault(path, TOOL)
    ttl = int(ttl_fault.delay_seconds * 1000) if ttl_fault is not None else min(requested_ttl or MAX_TTL_MS,
                                                                                  MAX_TTL_MS)
    work = delay.delay_seconds if delay is not None and delay.mode == "delay" else WORK_SECONDS
    now = time.time()
    task_id = "task-" + uuid.uuid4().hex[:16]
    with writing(path) as conn:
        conn.execute("INSERT INTO mcp_tasks (task_id, status, status_message, created_at, updated_at, due_at, "
                     "ttl_ms, arguments, idempotency_key) VALUES (?, 'working', 'queued', ?, ?, ?, ?, ?, ?)",
                     (task_id, now, now, now + work, ttl, json.dumps(arguments), key))
    threading.Thread(target=_apply_when_due, args=(path, task_id, work), daemon=True).start()
    row = _row(path, task_id)
    assert row is not None
    return row


def _apply_when_due(path: str, task_id: str, work: float) -> None:
    time.sleep(max(work, 0.0))
    advance(path, task_id, expired_too=True)


def advance(path: str, task_id: str, expired_too: bool = False) -> None:
    """Apply the task's work if it is due and nobody has: claimed by one guarded update. The
    creating process applies it even past the time to live (the job ran; only its record is gone)."""
    now = time.time()
    ttl_clause = "" if expired_too else " AND created_at + ttl_ms / 1000.0 >= ?"
    with writing(path) as conn:
        moved = conn.execute(
            "UPDATE mcp_tasks SET applying = 1, status_message = 'closing the ticket', updated_at = ? "
            f"WHERE task_id = ? AND status = 'working' AND applying = 0 AND due_at <= ?{ttl_clause}",
            (now, task_id, now, *(() if expired_too else (now,)))).rowcount
        row = conn.execute("SELECT arguments, idempotency_key FROM mcp_tasks WHERE task_id = ?",
                           (task_id,)).fetchone()
    if not moved or row is None:
        return
    args = json.loads(row["arguments"])
    try:
        done = store.close_ticket(path, args["ticket_id"], int(args["expected_version"]),
                                  idempotency_key=row["idempotency_key"])
        status, result = "completed", structured(done)
    except store.Refused as exc:
        status, result = "failed", error_result(exc.reason, str(exc), reason=exc.reason)
    with writing(path) as conn:
        conn.execute("UPDATE mcp_tasks SET status = ?, status_message = ?, result = ?, updated_at = ? "
                     "WHERE task_id = ?", (status, f"ticket {status}", result.model_dump_json(by_alias=True,
                                                                                           exclude_none=True),
                                           time.time(), task_id))


def cancel(path: str, task_id: str) -> dict[str, Any]:
    row = _known(path, task_id)
    if row["status"] in TERMINAL:
        raise MCPError(INVALID_PARAMS, f"task {task_id!r} is already {row['status']}: it cannot be cancelled")
    with writing(path) as conn:
        conn.execute("UPDATE mcp_tasks SET status = 'cancelled', status_message = 'cancelled by the requestor', "
                     "updated_at = ? WHERE task_id = ? AND status = 'working' AND applying = 0",
                     (time.time(), task_id))
    return _known(path, task_id)


async def result(path: str, task_id: str) -> dict[str, Any]:
    """The task's result once it is terminal (``tasks/result`` blocks while it works, as the spec says)."""
    deadline = time.monotonic() + RESULT_WAIT_SECONDS
    while True:
        row = _known(path, task_id)
        if row["status"] in TERMINAL:
            break
        if time.monotonic() > deadline:
            raise MCPError(INVALID_PARAMS, f"task {task_id!r} is still working")
        await anyio.sleep(POLL_INTERVAL_MS / 1000)
    if row["status"] == "cancelled" or row["result"] is None:
        raise MCPError(INVALID_PARAMS, f"task {task_id!r} was {row['status']}: it has no result")
    payload = json.loads(row["result"])
    meta = {"io.modelcontextprotocol/related-task": {"taskId": task_id}}
    return {**payload, "_meta": meta}


class SorTasks(Extension):
    """The Tasks surface of one writer process over its database."""

    identifier = IDENTIFIER

    def __init__(self, path: str) -> None:
        self.path = path
        init(path)

    def tools(self) -> Sequence[ToolBinding]:
        async def close_ticket_task(ticket_id: str, expected_version: int) -> CallToolResult:
            """Close a ticket as an MCP Task (task-augmented tools/call only; poll tasks/get, then tasks/result)."""
            raise MCPError(METHOD_NOT_FOUND, "close_ticket_task runs only as a task: send tools/call with `task`")

        return (ToolBinding(close_ticket_task),)

    def methods(self) -> Sequence[MethodBinding]:
        path = self.path

        async def get(ctx: Any, params: GetTaskRequestParams) -> GetTaskResult:
            return GetTaskResult.model_validate(_task(_known(path, params.task_id)))

        async def payload(ctx: Any, params: GetTaskPayloadRequestParams) -> dict[str, Any]:
            return await result(path, params.task_id)

        async def cancel_task(ctx: Any, params: CancelTaskRequestParams) -> CancelTaskResult:
            return CancelTaskResult.model_validate(_task(cancel(path, params.task_id)))

        return (MethodBinding("tasks/get", GetTaskRequestParams, get),
                MethodBinding("tasks/result", GetTaskPayloadRequestParams, payload),
                MethodBinding("tasks/cancel", CancelTaskRequestParams, cancel_task))

    async def middleware(self, ctx: Any, call_next: Any) -> Any:
        """A task-augmented ``tools/call`` of the task tool becomes a task. Middleware, not the
        extension's interceptor: the SDK sieves an interceptor's answer as a ``CallToolResult``,
        which a ``CreateTaskResult`` is not."""
        params = ctx.params if isinstance(ctx.params, dict) else {}
        if ctx.method != "tools/call" or params.get("name") != TOOL:
            return await call_next(ctx)
        task = params.get("task")
        if not isinstance(task, dict):
            raise MCPError(METHOD_NOT_FOUND, f"{TOOL} requires task-augmented execution (taskSupport: required)")
        meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
        key = meta.get(IDEMPOTENCY_META_KEY)
        ttl = task.get("ttl") if isinstance(task.get("ttl"), int) else None
        arguments = params.get("arguments") if isinstance(params.get("arguments"), dict) else {}
        row = await anyio.to_thread.run_sync(create, self.path, arguments, key if isinstance(key, str) else None, ttl)
        out = CreateTaskResult(task=Task.model_validate(_task(row))).model_dump(by_alias=True, mode="json",
                                                                                exclude_none=True)
        # 2026-07-28 requires a resultType; an extension's own one is not sieved as a core result.
        return {**out, "resultType": "task"} if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS else out


def install(server: Any) -> None:
    """What the SDK's server cannot declare itself: the ``tasks`` capability and the task tool's
    ``execution.taskSupport``."""
    low = server._lowlevel_server
    low.middleware.extend(ext.middleware for ext in server._extensions if isinstance(ext, SorTasks))
    plain_capabilities = low.get_capabilities

    def get_capabilities(*args: Any, **kwargs: Any) -> Any:
        caps = plain_capabilities(*args, **kwargs)
        return caps.model_copy(update={"tasks": ServerTasksCapability(
            cancel=TasksCancelCapability(),
            requests=ServerTasksRequestsCapability(tools=TasksToolsCapability(call=TasksCallCapability())))})

    low.get_capabilities = get_capabilities
    plain_list = server.list_tools

    async def list_tools() -> list[Any]:
        return [t.model_copy(update={"execution": ToolExecution(task_support="required")}) if t.name == TOOL else t
                for t in await plain_list()]

    server.list_tools = list_tools
