"""``proofline-audit``: the audit system's read-only MCP server, and its feed.

``python -m proofline_kit.audit feed --sor-db S [--db A] [--delay-ms N]`` copies the system of
record's effects into the audit store ``N`` ms after they were applied (default 300) until stopped.
``python -m proofline_kit.audit serve --transport stdio|http [--db A] [--port P --port-file F]``
serves the store: ``find_audit_entries`` (by idempotency key), ``search_audit`` (by key or
operation id) and ``service_restarts`` (the monitoring view of a service). It has no write tool:
both identities of the servers file may only read.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult
from pydantic import BaseModel

from proofline_kit.audit import store
from proofline_kit.sor.runtime import READ, error_result, in_thread, structured

SERVER_NAME = "proofline-audit"
VERSION = "1.0.0"


class Entry(BaseModel):
    seq: int
    tool: str
    idempotency_key: str | None
    resource: str
    detail: dict[str, Any]
    at: float
    ingested_at: float


class Entries(BaseModel):
    found: bool
    count: int
    entries: list[Entry]


class Restart(BaseModel):
    idempotency_key: str | None
    operation_id: str | None
    generation: int | None
    at: float


class ServiceView(BaseModel):
    service: str
    count: int
    restarts: list[Restart]


async def _answer(fetch: Any) -> CallToolResult:
    """Run a read; a store that cannot be read (not fed yet, locked too long) is ``unavailable``."""
    try:
        return structured(await in_thread(fetch))
    except ValueError as exc:
        return error_result("failed_before_side_effect", str(exc), reason="invalid_arguments")
    except Exception as exc:  # noqa: BLE001 - sqlite errors of every kind mean "cannot answer now"
        return error_result("unavailable", f"audit store unavailable: {exc}")


def build_server(db_path: str) -> MCPServer:
    server: MCPServer = MCPServer(SERVER_NAME, version=VERSION,
                                  log_level=os.environ.get("AUDIT_LOG_LEVEL", "WARNING"))  # type: ignore[arg-type]

    @server.tool(annotations=READ)
    async def find_audit_entries(idempotency_key: str) -> Annotated[CallToolResult, Entries]:
        """Every audited effect the system of record applied under an idempotency key."""
        return await _answer(lambda: store.find_entries(db_path, idempotency_key))

    @server.tool(annotations=READ)
    async def search_audit(idempotency_key: str | None = None,
                           operation_id: str | None = None) -> Annotated[CallToolResult, Entries]:
        """Audited effects by idempotency key and/or downstream operation id."""
        return await _answer(lambda: store.search(db_path, idempotency_key, operation_id))

    @server.tool(annotations=READ)
    async def service_restarts(service: str) -> Annotated[CallToolResult, ServiceView]:
        """The monitoring view of a service: every restart monitoring has observed."""
        return await _answer(lambda: store.service_view(db_path, service))

    return server


def feed(sor_db: str, db_path: str, delay_seconds: float, poll_seconds: float = 0.1) -> None:
    """Copy effects into the audit store until the process is stopped."""
    conn = store.init_db(db_path)
    source = None
    while True:
        try:
            source = source or store.open_source(sor_db)
            store.ingest(conn, source, delay_seconds)
        except Exception as exc:  # noqa: BLE001 - the system of record may not exist yet: open it again
            print(f"audit feed: {exc!r}", flush=True)
            if source is not None:
                source.close()
            source = None
        time.sleep(poll_seconds)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m proofline_kit.audit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fed = sub.add_parser("feed", help="copy the system of record's effects into the audit store")
    fed.add_argument("--sor-db", default=None, help="the system of record's file (default SOR_DB)")
    fed.add_argument("--db", default=None, help="the audit store (default AUDIT_DB, ./var/audit.sqlite3)")
    fed.add_argument("--delay-ms", type=float, default=None,
                     help=f"how late the audit log is (default AUDIT_DELAY_MS, {store.DEFAULT_DELAY_SECONDS * 1000:.0f})")
    serve = sub.add_parser("serve", help="the read-only MCP server over the audit store")
    serve.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    serve.add_argument("--db", default=None)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8766)
    serve.add_argument("--port-file", type=Path, default=None, help="HTTP: write the port listened on here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    db_path = str(store.resolve_path(args.db))
    if args.command == "feed":
        sor_db = args.sor_db or os.environ.get("SOR_DB")
        if not sor_db:
            raise SystemExit("feed needs --sor-db or SOR_DB")
        delay_ms = args.delay_ms if args.delay_ms is not None else float(
            os.environ.get("AUDIT_DELAY_MS", store.DEFAULT_DELAY_SECONDS * 1000))
        feed(sor_db, db_path, delay_ms / 1000)
        return
    server = build_server(db_path)
    if args.transport == "stdio":
        server.run("stdio")
    elif args.port_file is not None:
        from proofline_kit.sor.server import _serve_on_own_socket

        _serve_on_own_socket(server, args.host, args.port, args.port_file, json_response=True)
    else:
        server.run("streamable-http", host=args.host, port=args.port, stateless_http=True, json_response=True)
