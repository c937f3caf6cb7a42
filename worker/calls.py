"""The MCP requests the runtime makes, as coroutines run on a session's event loop."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from mcp import Client

from proofline.canonical import tool_contract_hash
from proofline.errors import AbsoluteDeadlineReached

IDEMPOTENCY_META_KEY = "proofline/idempotency_key"
ACTION_META_KEY = "proofline/action_id"
#: Increases on every lease acquisition: a server that remembers the highest token it saw per key
#: can refuse a write from a stale lease holder.
FENCING_META_KEY = "proofline/fencing_token"


#: The behaviour hints (``readOnlyHint``, ``destructiveHint``, ...) of every tool this process has
#: listed, by tool contract hash. The hash covers the annotations, so a hint looked up by the hash an
#: envelope was approved (and revalidated) for is exactly what the approver's tool declared.
TOOL_HINTS: dict[str, dict[str, Any]] = {}
_MAX_HINTS = 10_000


async def live_tool_hashes(client: Client) -> dict[str, str]:
    """Contract hashes of every tool the live server lists, bypassing any cache."""
    hashes: dict[str, str] = {}
    cursor: str | None = None
    while True:
        page = await client.list_tools(cursor=cursor, cache_mode="bypass")
        for tool in page.tools:
            digest = hashes[tool.name] = tool_contract_hash(tool)
            if digest not in TOOL_HINTS and len(TOOL_HINTS) < _MAX_HINTS:
                annotations = getattr(tool, "annotations", None)
                TOOL_HINTS[digest] = (annotations.model_dump(mode="json", exclude_none=True, by_alias=True)
                                      if annotations is not None and hasattr(annotations, "model_dump") else {})
        cursor = page.next_cursor
        if not cursor:
            return hashes


@dataclass
class ProgressLog:
    """Progress notifications of one call: counted, and kept up to a bound. Each one restarts the
    request timeout (``on_progress``); none moves the absolute deadline."""

    limit: int
    kept: list[dict[str, Any]] = field(default_factory=list)
    total: int = 0
    on_progress: Any = None

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        self.total += 1
        if len(self.kept) < self.limit:
            self.kept.append({"progress": progress, "total": total, "message": (message or "")[:200]})
        if self.on_progress is not None:
            self.on_progress()


#: The request-timeout restart of each call in flight, by action id (the sessions' event loop is
#: the only thread that touches it). While the runtime itself is busy answering the server (an
#: elicitation put to approvers), the server is not the one keeping the call waiting.
_IN_FLIGHT: dict[str, Any] = {}


def restart_request_timeout(action_id: str) -> None:
    """Restart the request timeout of ``action_id``'s call in flight (never past its absolute deadline)."""
    restart = _IN_FLIGHT.get(action_id)
    if restart is not None:
        restart()


async def call_tool(
    client: Client, *, tool: str, arguments: dict[str, Any], idempotency_key: str, action_id: str,
    timeout_seconds: float, deadline_monotonic: float, progress: ProgressLog, fencing_token: int = 0,
    trace_meta: dict[str, str] | None = None,
) -> tuple[Any, float]:
    """Call a tool with the key in ``_meta``, a request timeout and the absolute deadline.

    The request timeout is how long the caller waits without hearing from the server: each
    progress notification restarts it. The absolute deadline never moves, however much progress
    arrives: the call is cut there and :class:`AbsoluteDeadlineReached` raised (the SDK sends the
    server ``notifications/cancelled`` as the scope is cancelled).
    """
    started = time.monotonic()
    absolute = anyio.current_time() + max(0.001, deadline_monotonic - started)

    def due(loop_now: float) -> float:
        return min(loop_now + timeout_seconds, absolute)

    with anyio.CancelScope(deadline=due(anyio.current_time())) as scope:
        def restart() -> None:
            scope.deadline = due(anyio.current_time())

        progress.on_progress = restart
        _IN_FLIGHT[action_id] = restart
        try:
            result = await client.call_tool(
                tool, arguments, progress_callback=progress,
                meta={IDEMPOTENCY_META_KEY: idempotency_key, ACTION_META_KEY: action_id,
                      FENCING_META_KEY: fencing_token,
                      **(trace_meta or {})},  # W3C traceparent: a traced server continues the trace
            )
        finally:
            progress.on_progress = None
            if _IN_FLIGHT.get(action_id) is restart:
                del _IN_FLIGHT[action_id]
    if scope.cancelled_caught:
        elapsed = time.monotonic() - started
        if scope.deadline >= absolute:
            raise AbsoluteDeadlineReached(f"cut at the absolute deadline after {elapsed:.3f} s",
                                          progress_notifications=progress.total)
        raise TimeoutError(f"no answer and no progress for {timeout_seconds} s")
    return result, time.monotonic() - started


async def read_tool(client: Client, *, tool: str, arguments: dict[str, Any], timeout_seconds: float,
                    trace_meta: dict[str, str] | None = None) -> Any:
    with anyio.fail_after(timeout_seconds + 0.5):
        return await client.call_tool(tool, arguments, read_timeout_seconds=timeout_seconds, meta=trace_meta or None)
