"""The MCP requests the runtime makes, as coroutines run on a session's event loop."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from mcp import Client

from proofline.canonical import tool_contract_hash

IDEMPOTENCY_META_KEY = "proofline/idempotency_key"
ACTION_META_KEY = "proofline/action_id"
#: Increases on every lease acquisition: a server that remembers the highest token it saw per key
#: can refuse a write from a stale lease holder.
FENCING_META_KEY = "proofline/fencing_token"


async def live_tool_hashes(client: Client) -> dict[str, str]:
    """Contract hashes of every tool the live server lists, bypassing any cache."""
    hashes: dict[str, str] = {}
    cursor: str | None = None
    while True:
        page = await client.list_tools(cursor=cursor, cache_mode="bypass")
        for tool in page.tools:
            hashes[tool.name] = tool_contract_hash(tool)
        cursor = page.next_cursor
        if not cursor:
            return hashes


@dataclass
class ProgressLog:
    """Progress notifications of one call: counted, and kept up to a bound."""

    limit: int
    kept: list[dict[str, Any]] = field(default_factory=list)
    total: int = 0

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        self.total += 1
        if len(self.kept) < self.limit:
            self.kept.append({"progress": progress, "total": total, "message": (message or "")[:200]})


async def call_tool(
    client: Client, *, tool: str, arguments: dict[str, Any], idempotency_key: str, action_id: str,
    timeout_seconds: float, deadline_monotonic: float, progress: ProgressLog, fencing_token: int = 0,
    trace_meta: dict[str, str] | None = None,
) -> tuple[Any, float]:
    """Call a tool with the key in ``_meta``, a request timeout and the absolute deadline.

    Progress never extends the deadline: the whole call is bounded by ``fail_after``, whatever
    the SDK does with its per-request timeout on progress. ``trace_meta`` (W3C ``traceparent``)
    goes in ``_meta`` too, so a traced tool server continues the action's trace.
    """
    started = time.monotonic()
    remaining = max(0.001, deadline_monotonic - started)
    with anyio.fail_after(min(timeout_seconds, remaining) + 0.5):
        result = await client.call_tool(
            tool, arguments, read_timeout_seconds=min(timeout_seconds, remaining), progress_callback=progress,
            meta={IDEMPOTENCY_META_KEY: idempotency_key, ACTION_META_KEY: action_id, FENCING_META_KEY: fencing_token,
                  **(trace_meta or {})},
        )
    return result, time.monotonic() - started


async def read_tool(client: Client, *, tool: str, arguments: dict[str, Any], timeout_seconds: float,
                    trace_meta: dict[str, str] | None = None) -> Any:
    with anyio.fail_after(timeout_seconds + 0.5):
        return await client.call_tool(tool, arguments, read_timeout_seconds=timeout_seconds, meta=trace_meta or None)
