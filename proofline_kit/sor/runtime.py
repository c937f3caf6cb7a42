"""What wraps every ``proofline-sor`` tool: configuration, role check, fault switches, result shapes.

Errors a caller must branch on come back as ``is_error`` results whose structured content is
``{"error_class", "message", "reason"?}`` with ``error_class`` one of ``failed_before_side_effect``,
``failed_after_side_effect`` or ``unavailable``.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, TextContent, ToolAnnotations, ToolListChangedNotification

from proofline_kit.sor import store
from proofline_kit.sor.asks import ONLY, ask_client
from proofline_kit.sor.core import unapplied
from proofline_kit.sor.db import now
from proofline_kit.sor.faults import DROP_RESPONSE_DEFAULT_SECONDS, READ_LAG, READ_OUTAGE, Fault

#: Request ``_meta`` key carrying the caller's idempotency key.
IDEMPOTENCY_META_KEY = "proofline/idempotency_key"
SERVER_NAME = "proofline-sor"

READ = ToolAnnotations(
    read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False
)
CREATE = ToolAnnotations(
    read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False
)
DESTRUCTIVE = ToolAnnotations(
    read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False
)


@dataclass(frozen=True)
class SorConfig:
    """What one server process is: its database, identity, tool-contract variant and version."""

    db_path: str
    role: str = "writer"
    contract_variant: str = "1"
    version: str = "1.0.0"

    @classmethod
    def from_env(cls, db_path: str | None = None, role: str | None = None) -> SorConfig:
        """Explicit arguments win over ``SOR_DB`` / ``SOR_ROLE`` / ``SOR_CONTRACT_VARIANT`` / ``SOR_VERSION``."""
        role = role or os.environ.get("SOR_ROLE", "writer")
        if role not in ("writer", "reader"):
            raise ValueError(f"role must be writer or reader, not {role!r}")
        path = store.resolve_path(db_path)
        return cls(
            db_path=str(path),
            role=role,
            contract_variant=os.environ.get("SOR_CONTRACT_VARIANT") or _stored_variant(path) or "1",
            version=os.environ.get("SOR_VERSION", "1.0.0"),
        )


def _stored_variant(path: Any) -> str | None:
    """The variant a test set in the store (``store.set_contract_variant``); none in a new store."""
    try:
        return store.contract_variant(path)
    except sqlite3.Error:
        return None


def error_result(error_class: str, message: str, reason: str | None = None) -> CallToolResult:
    """A tool error with a machine-readable class in its structured content (and the same JSON as text)."""
    payload: dict[str, Any] = {"error_class": error_class, "message": message}
    if reason is not None:
        payload["reason"] = reason
    return CallToolResult(
        is_error=True,
        content=[TextContent(type="text", text=json.dumps(payload))],
        structured_content=payload,
    )


def structured(data: dict[str, Any]) -> CallToolResult:
    """A success result carrying ``data`` as structured content and as JSON text for text-only clients."""
    return CallToolResult(content=[TextContent(type="text", text=json.dumps(data))], structured_content=data)


def text(body: str) -> CallToolResult:
    """A success result with text content only (no structured content)."""
    return CallToolResult(content=[TextContent(type="text", text=body)])


def nested(result: CallToolResult, depth: int) -> CallToolResult:
    """The same answer with a ``detail`` value nested ``depth`` levels deep (the ``deep_nesting``
    fault), in its structured content when it has one, else as JSON text."""
    detail: Any = 1
    for _ in range(depth):
        detail = {"a": detail}
    if isinstance(result.structured_content, dict):
        data = {**result.structured_content, "detail": detail}
        return CallToolResult(content=[TextContent(type="text", text=json.dumps(data))], structured_content=data)
    return text(json.dumps({"detail": detail}))


def padded(result: CallToolResult, size: int) -> CallToolResult:
    """The same answer made ``size`` bytes larger (the ``huge_result`` fault: a server that returns far
    more than anyone asked for). Structured content gains a ``padding`` field; text gains trailing
    spaces, so a pattern over the text still matches."""
    if isinstance(result.structured_content, dict):
        data = {**result.structured_content, "padding": "x" * size}
        return CallToolResult(content=result.content, structured_content=data, is_error=result.is_error)
    first = result.content[0].text if result.content else ""
    return CallToolResult(content=[TextContent(type="text", text=first + " " * size)], is_error=result.is_error)


def idempotency_key(ctx: Context) -> str | None:
    """The caller's key from the request ``_meta`` (a plain dict in mcp 2.3), if it sent one."""
    meta = ctx.request_context.meta or {}
    key = meta.get(IDEMPOTENCY_META_KEY)
    return key if isinstance(key, str) and key else None


async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run blocking SQLite work off the event loop.

    Not abandoned on cancellation: a client timeout cancels the tool, but a transaction that has
    started still commits or rolls back as a whole before the cancellation lands.
    """
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


#: Seconds between two notifications of a ``progress_flood`` (100 a second).
FLOOD_INTERVAL_SECONDS = 0.01


async def before_fault(ctx: Context, fault: Fault | None, sent: list[int] | None = None) -> None:
    """The part of a fault that happens before the tool acts: waiting, or flooding progress
    (``delay_seconds`` long, one notification every 10 ms; ``sent`` counts them)."""
    if fault is None:
        return
    if fault.mode == "delay":
        await anyio.sleep(fault.delay_seconds)
    elif fault.mode == "progress_flood":
        count = int(fault.delay_seconds / FLOOD_INTERVAL_SECONDS)
        for i in range(count):
            await ctx.report_progress(i + 1, count, "flood")
            if sent is not None:
                sent[0] = i + 1
            await anyio.sleep(FLOOD_INTERVAL_SECONDS)


class Runner:
    """Applies the role check, fault switches and error mapping around every tool body."""

    def __init__(self, config: SorConfig) -> None:
        self.config = config
        self.readonly = config.role == "reader"

    async def write(
        self,
        ctx: Context,
        tool: str,
        apply: Callable[[str | None], Awaitable[dict[str, Any]]],
        lie: Callable[[], dict[str, Any]],
        render: Callable[[dict[str, Any]], CallToolResult],
    ) -> CallToolResult:
        """Run a mutating tool: ``apply(key)`` commits, ``lie()`` fabricates, ``render`` shapes the answer."""
        if self.readonly:
            return error_result(
                "failed_before_side_effect", "read-only identity", reason="read_only_identity"
            )
        key = idempotency_key(ctx)
        try:
            fault = await in_thread(store.take_fault, self.config.db_path, tool)
            sent = [0]
            try:
                await before_fault(ctx, fault, sent)
            except anyio.get_cancelled_exc_class():
                # The caller cancelled (or went away) before anything was applied: honoured.
                with anyio.CancelScope(shield=True):
                    await in_thread(store.record_cancellation, self.config.db_path, tool, key, "honoured",
                                    f"{sent[0]} progress notifications sent" if sent[0] else "")
                raise
            mode = fault.mode if fault else None
            if mode in ("server_requests", *ONLY) or ctx.input_responses is not None:
                asked = await ask_client(ctx, self.config.db_path, only=ONLY.get(mode or ""))
                if asked is not None:
                    return asked  # type: ignore[return-value] - the 2026-07-28 round trip, nothing applied
            if mode == "list_changed":
                # On this request's own stream: it reaches the client on every transport.
                await ctx.session.send_notification(ToolListChangedNotification(),
                                                    related_request_id=ctx.request_id)
            if mode == "ignore_cancel":
                return render(await self._ignoring_cancel(tool, key, fault.delay_seconds, apply))
            if mode == "fail_before_commit":
                return error_result("failed_before_side_effect", f"injected failure before commit in {tool}")
            if mode == "lie":
                return render(await in_thread(lie))
            if mode == "lie_consistently":
                # Its own record says done, and its own reads will agree: only the effect is missing.
                token = unapplied.set(True)
                try:
                    return render(await apply(key))
                finally:
                    unapplied.reset(token)
            result = await apply(key)
            if mode == "apply_twice":
                # A downstream that applies the request twice (a retry inside the server): a
                # prohibited change verification must find, whatever the answer says.
                await apply(key)
        except store.Refused as refused:
            return error_result(refused.error_class, refused.message, reason=refused.reason)
        except sqlite3.OperationalError as exc:
            # A failed statement or COMMIT leaves the transaction rolled back: nothing was applied.
            return error_result(
                "failed_before_side_effect", f"store unavailable: {exc}", reason="store_unavailable"
            )
        # From here on the effect is committed: the faults below only damage the answer.
        if mode == "drop_response":
            await anyio.sleep(fault.delay_seconds or DROP_RESPONSE_DEFAULT_SECONDS)
        if mode == "fail_after_commit":
            return error_result("failed_after_side_effect", f"injected failure after commit in {tool}")
        if mode == "huge_result":
            return padded(render(result), int(fault.delay_seconds * 1024 * 1024))
        if mode == "deep_nesting":
            # Committed, then answered with a value nested ``delay_seconds`` levels deep (default 100).
            return nested(render(result), int(fault.delay_seconds) or 100)
        return render(result)

    async def _ignoring_cancel(
        self, tool: str, key: str | None, wait: float, apply: Callable[[str | None], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """The ``ignore_cancel`` fault: hold the call up to ``wait`` seconds; if the caller's
        ``notifications/cancelled`` arrives meanwhile, log it and apply the write anyway (a
        receiver may ignore a cancellation), then stop answering. Without one, apply after ``wait``."""
        try:
            await anyio.sleep(wait)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await in_thread(store.record_cancellation, self.config.db_path, tool, key, "ignored")
                await apply(key)
            raise
        return await apply(key)

    async def read(
        self, ctx: Context, tool: str, fetch: Callable[[], Any], render: Callable[[Any], CallToolResult],
        as_of: Callable[[float], Any] | None = None,
    ) -> CallToolResult:
        """Run a read tool: honours the ``*read*`` outage switch, this identity's replica position
        (for tools that can read ``as_of`` a past time) and the tool's own fault."""
        path = self.config.db_path
        try:
            outage = await in_thread(store.take_fault, path, READ_OUTAGE, readonly=self.readonly)
            if outage is None:
                outage = await in_thread(store.take_fault, path, f"{READ_OUTAGE}:{self.config.role}",
                                         readonly=self.readonly)
            if outage is not None and outage.mode == "unavailable":
                return error_result("unavailable", "read path unavailable (injected outage)")
            fault = await in_thread(store.take_fault, path, tool, readonly=self.readonly)
            await before_fault(ctx, fault)
            if fault is not None and fault.mode in ("fail_before_commit", "fail_after_commit", "unavailable"):
                return error_result("unavailable", f"injected failure in {tool}")
            lag = await in_thread(store.take_fault, path, f"{READ_LAG}:{self.config.role}", readonly=True)
            if lag is not None and lag.mode == "read_lag" and as_of is not None:
                data = await in_thread(as_of, min(lag.delay_seconds, now()))
            else:
                data = await in_thread(fetch)
        except sqlite3.OperationalError as exc:
            # e.g. the reader started before the writer created the file, or the file is locked too long
            return error_result("unavailable", f"store unavailable: {exc}")
        if fault is not None and fault.mode == "drop_response":
            await anyio.sleep(fault.delay_seconds or DROP_RESPONSE_DEFAULT_SECONDS)
        return render(data)
