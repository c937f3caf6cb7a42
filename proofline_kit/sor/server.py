"""The ``proofline-sor`` MCP server: the enterprise system Proofline acts on, with fault switches.

Two identities share one SQLite file: ``writer`` may call every tool; ``reader`` opens the file
read-only and refuses write tools, so a verifier's read path can never change the record.

Run it with ``python -m proofline_kit.sor --transport stdio|http [--host H --port P]
[--role writer|reader] [--db PATH]``; over HTTP the endpoint is ``http://H:P/mcp``. With
``--port 0 --port-file F`` it binds a free port itself and writes the port it got to F (atomically,
once it listens), so nothing has to guess a free port and bind it later. With ``SOR_OAUTH_ISSUER``
set (port-file mode), every request needs an OAuth token of that authorization server
(proofline_kit/oauth/resource.py).
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Sequence
from pathlib import Path

from mcp.server.mcpserver import MCPServer

from proofline.listen import listening_socket
from proofline_kit.sor import store, tasks
from proofline_kit.sor.runtime import IDEMPOTENCY_META_KEY, SERVER_NAME, Runner, SorConfig
from proofline_kit.sor.tools import register

__all__ = ["IDEMPOTENCY_META_KEY", "SERVER_NAME", "SorConfig", "build_server", "main"]

_keepers: list = []


def build_server(config: SorConfig) -> MCPServer:
    """An ``MCPServer`` named ``proofline-sor`` with every tool bound to ``config``.

    A writer creates the schema first; a reader never touches the file until a call arrives
    (it cannot create anything, and reports ``unavailable`` until the writer has).
    """
    if config.role == "writer":
        store.init_db(config.db_path)
        # Held open for the server's life: while any connection is open SQLite keeps the WAL's
        # -wal/-shm files, and a reader whose directory is mounted read-only (a sandboxed read
        # identity) can only open a WAL database whose -shm already exists.
        _keepers.append(store.connect(config.db_path))
    # WARNING by default: the SDK logs every refused call at INFO, which is noise on stderr here.
    # The "tasks" variant's writer serves MCP Tasks (proofline_kit/sor/tasks.py).
    with_tasks = config.contract_variant == tasks.VARIANT and config.role == "writer"
    server: MCPServer = MCPServer(
        SERVER_NAME,
        version=config.version,
        log_level=os.environ.get("SOR_LOG_LEVEL", "WARNING"),  # type: ignore[arg-type]
        extensions=[tasks.SorTasks(config.db_path)] if with_tasks else None,
    )
    register(server, Runner(config), config)
    if with_tasks:
        tasks.install(server)
    return server


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; role and database fall back to ``SOR_ROLE`` and ``SOR_DB``."""
    parser = argparse.ArgumentParser(prog="python -m proofline_kit.sor", description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--role", choices=("writer", "reader"), default=None)
    parser.add_argument("--db", default=None)
    # Plain JSON bodies cannot carry progress notifications; --sse answers with an event stream.
    parser.add_argument("--sse", action="store_true", help="HTTP: stream responses (progress arrives)")
    parser.add_argument("--port-file", type=Path, default=None, help="HTTP: write the port listened on here")
    return parser.parse_args(argv)


def _serve_on_own_socket(server: MCPServer, host: str, port: int, port_file: Path, json_response: bool,
                         role: str = "writer") -> None:
    """Bind first, report the port, then serve on that very socket (no window for another bind)."""
    import anyio
    import uvicorn

    sock = listening_socket(host, port)
    tmp = port_file.with_name(port_file.name + ".tmp")
    tmp.write_text(f"{sock.getsockname()[1]}\n")
    os.replace(tmp, port_file)
    app = server.streamable_http_app(stateless_http=True, json_response=json_response, host=host)
    issuer = os.environ.get("SOR_OAUTH_ISSUER")
    if issuer:
        # Tokens of the kit's authorization server required, a write scope for the writer.
        from proofline_kit.oauth.resource import RequireOAuth

        app = RequireOAuth(app, issuer, "sor:write" if role == "writer" else "sor:read")  # type: ignore[assignment]
    config = uvicorn.Config(app, log_level=os.environ.get("SOR_LOG_LEVEL", "WARNING").lower())
    anyio.run(lambda: uvicorn.Server(config).serve(sockets=[sock]))


def main(argv: Sequence[str] | None = None) -> None:
    """Serve until stdin closes (stdio) or the process is stopped (http)."""
    args = parse_args(argv)
    config = SorConfig.from_env(db_path=args.db, role=args.role)
    server = build_server(config)
    # What start-up built lives as long as the server: collections skip it from now on (a full
    # collection walked it in 35-42 ms, a stall on whichever request was being answered).
    gc.collect()
    gc.freeze()
    if args.transport == "stdio":
        server.run("stdio")
    elif args.port_file is not None:
        _serve_on_own_socket(server, args.host, args.port, args.port_file, json_response=not args.sse,
                             role=config.role)
    else:
        # Stateless + JSON responses: no session to lose on restart, one plain JSON body per call.
        server.run(
            "streamable-http", host=args.host, port=args.port, stateless_http=True, json_response=not args.sse
        )
