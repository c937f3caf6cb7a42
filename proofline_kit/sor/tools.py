"""The tools of ``proofline-sor``. Each body is tiny: ``Runner`` does roles, faults and errors.

Result shapes are deliberately uneven, like real enterprise APIs: most tools return structured
content with an output schema, but ``issue_refund`` and ``get_service`` answer in text only, so a
client must extract values from text.
"""

# No ``from __future__ import annotations``: the SDK inspects these signatures at registration.
import json
from typing import Annotated, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult

from proofline_kit.sor import models, store
from proofline_kit.sor.runtime import (
    CREATE,
    DESTRUCTIVE,
    READ,
    Runner,
    SorConfig,
    error_result,
    in_thread,
    structured,
    text,
)


def _refund_text(r: dict[str, Any]) -> CallToolResult:
    return text(f"refund {r['refund_id']} issued for {r['amount_cents']} cents on {r['account']}")


def register(server: MCPServer, run: Runner, config: SorConfig) -> None:
    """Declare every tool on ``server``, bound to ``config``'s database and contract variant."""
    path = config.db_path

    async def _create(
        ctx: Context, tenant: str, title: str, owner: str, priority: str | None
    ) -> CallToolResult:
        async def apply(key: str | None) -> dict[str, Any]:
            return await in_thread(
                store.create_ticket, path, tenant, title, owner, idempotency_key=key, priority=priority
            )

        def lie() -> dict[str, Any]:
            return {
                "ticket_id": store.phantom_id(path, "tickets", "T"),
                "status": "open",
                "version": 1,
                "deduplicated": False,
            }

        return await run.write(ctx, "create_ticket", apply, lie, structured)

    if config.contract_variant == "2":
        # Variant 2 publishes a different input schema, so the tool contract hash changes.
        @server.tool(annotations=CREATE)
        async def create_ticket(
            tenant: str, title: str, owner: str, ctx: Context, priority: str | None = None
        ) -> Annotated[CallToolResult, models.TicketCreated]:
            """Open a ticket. Honours the idempotency key in _meta["proofline/idempotency_key"]."""
            return await _create(ctx, tenant, title, owner, priority)
    elif config.contract_variant == "3":
        # Variant 3 keeps every schema and rewords the description only (what a model reads).
        @server.tool(annotations=CREATE)
        async def create_ticket(
            tenant: str, title: str, owner: str, ctx: Context
        ) -> Annotated[CallToolResult, models.TicketCreated]:
            """Open a ticket and page its owner. Honours the idempotency key in _meta["proofline/idempotency_key"]."""
            return await _create(ctx, tenant, title, owner, None)
    else:

        @server.tool(annotations=CREATE)
        async def create_ticket(
            tenant: str, title: str, owner: str, ctx: Context
        ) -> Annotated[CallToolResult, models.TicketCreated]:
            """Open a ticket. Honours the idempotency key in _meta["proofline/idempotency_key"]."""
            return await _create(ctx, tenant, title, owner, None)

    @server.tool(annotations=DESTRUCTIVE)
    async def close_ticket(
        ticket_id: str, expected_version: int, ctx: Context
    ) -> Annotated[CallToolResult, models.TicketClosed]:
        """Close a ticket if its version still equals expected_version. Does not honour idempotency keys."""

        async def apply(key: str | None) -> dict[str, Any]:
            return await in_thread(store.close_ticket, path, ticket_id, expected_version, idempotency_key=key)

        def lie() -> dict[str, Any]:
            return {"ticket_id": ticket_id, "status": "closed", "version": expected_version + 1}

        return await run.write(ctx, "close_ticket", apply, lie, structured)

    @server.tool(annotations=DESTRUCTIVE)
    async def restart_service(
        service: str, tenant: str, expected_generation: int, ctx: Context
    ) -> Annotated[CallToolResult, models.OperationAccepted]:
        """Start an asynchronous restart; poll get_operation. Does not honour idempotency keys."""

        async def apply(key: str | None) -> dict[str, Any]:
            await ctx.report_progress(1, 3, "checking service")
            ttl = await in_thread(store.take_fault, path, store.OPERATION_TTL)
            result = await in_thread(
                store.restart_service, path, service, tenant, expected_generation, idempotency_key=key,
                record_ttl_seconds=ttl.delay_seconds if ttl is not None else None,
            )
            await ctx.report_progress(2, 3, f"operation {result['operation_id']} started")
            await ctx.report_progress(3, 3, "accepted")
            return result

        def lie() -> dict[str, Any]:
            return {"operation_id": store.phantom_id(path, "operations", "op"), "state": "accepted"}

        return await run.write(ctx, "restart_service", apply, lie, structured)

    @server.tool(annotations=DESTRUCTIVE, structured_output=False)
    async def issue_refund(
        account: str, tenant: str, amount_cents: int, reason: str, ctx: Context
    ) -> CallToolResult:
        """Refund amount_cents out of an account. Answers in text only. Does not honour idempotency keys."""

        async def apply(key: str | None) -> dict[str, Any]:
            return await in_thread(
                store.issue_refund, path, account, tenant, amount_cents, reason, idempotency_key=key
            )

        def lie() -> dict[str, Any]:
            return {
                "refund_id": store.phantom_id(path, "refunds", "R"),
                "account": account,
                "amount_cents": amount_cents,
            }

        return await run.write(ctx, "issue_refund", apply, lie, _refund_text)

    @server.tool(annotations=DESTRUCTIVE)
    async def reverse_refund(
        refund_id: str, ctx: Context
    ) -> Annotated[CallToolResult, models.RefundReversed]:
        """Reverse a refund and restore the balance (compensation). Idempotent."""

        async def apply(key: str | None) -> dict[str, Any]:
            return await in_thread(store.reverse_refund, path, refund_id, idempotency_key=key)

        def lie() -> dict[str, Any]:
            return {"refund_id": refund_id, "status": "reversed", "deduplicated": False}

        return await run.write(ctx, "reverse_refund", apply, lie, structured)

    _register_reads(server, run, path)
    _register_previews(server, run, path)


def _register_previews(server: MCPServer, run: Runner, path: str) -> None:
    """Prepare tools: what a write would change, read-only (they run on the reader identity too)."""

    @server.tool(annotations=READ)
    async def preview_close_ticket(
        ticket_id: str, expected_version: int, ctx: Context
    ) -> Annotated[CallToolResult, models.Plan]:
        """Preview close_ticket: the status and version change, the plan id and the ticket's current version. Changes nothing."""
        return await run.read(
            ctx, "preview_close_ticket", lambda: store.preview_close_ticket(path, ticket_id, expected_version),
            structured,
        )

    @server.tool(annotations=READ)
    async def preview_refund(account: str, amount_cents: int, ctx: Context) -> Annotated[CallToolResult, models.Plan]:
        """Preview issue_refund: the balance before and after, the plan id and the account's current version. Changes nothing."""
        return await run.read(
            ctx, "preview_refund", lambda: store.preview_refund(path, account, amount_cents), structured
        )


def _register_reads(server: MCPServer, run: Runner, path: str) -> None:
    @server.tool(annotations=READ)
    async def get_ticket(ticket_id: str, ctx: Context) -> Annotated[CallToolResult, models.TicketLookup]:
        """Read a ticket by id."""
        return await run.read(ctx, "get_ticket", lambda: store.get_ticket(path, ticket_id), structured)

    @server.tool(annotations=READ)
    async def find_ticket_by_key(
        idempotency_key: str, ctx: Context
    ) -> Annotated[CallToolResult, models.TicketLookup]:
        """Find the ticket created under an idempotency key."""
        return await run.read(
            ctx, "find_ticket_by_key", lambda: store.find_ticket_by_key(path, idempotency_key), structured
        )

    def _service_text(doc: dict[str, Any] | None) -> CallToolResult:
        if doc is None:
            return error_result("not_found", "no such service", reason="not_found")
        return text(json.dumps(doc))

    @server.tool(annotations=READ, structured_output=False)
    async def get_service(service: str, ctx: Context) -> CallToolResult:
        """Read a service's state as a JSON document in text content."""
        return await run.read(ctx, "get_service", lambda: store.get_service(path, service), _service_text,
                              as_of=lambda at: store.get_service(path, service, as_of=at))

    @server.tool(annotations=READ)
    async def get_operation(
        operation_id: str, ctx: Context
    ) -> Annotated[CallToolResult, models.OperationLookup]:
        """Read an asynchronous operation (state running, completed or failed)."""
        return await run.read(
            ctx, "get_operation", lambda: store.get_operation(path, operation_id), structured
        )

    @server.tool(annotations=READ)
    async def get_account(account: str, ctx: Context) -> Annotated[CallToolResult, models.AccountLookup]:
        """Read an account with its refunds."""
        return await run.read(ctx, "get_account", lambda: store.get_account(path, account), structured)

    @server.tool(annotations=READ)
    async def find_refund_by_key(
        idempotency_key: str, ctx: Context
    ) -> Annotated[CallToolResult, models.RefundLookup]:
        """Find every refund issued under an idempotency key (refunds do not deduplicate)."""
        return await run.read(
            ctx, "find_refund_by_key", lambda: store.find_refund_by_key(path, idempotency_key), structured
        )
