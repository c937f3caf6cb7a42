"""``proofline gateway``: governed action types served to agents as MCP tools."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from proofline.commands.base import emit, settings

#: With ``--stdio``: the environment variable that holds the served agent's bearer token.
TOKEN_ENV = "PROOFLINE_GATEWAY_TOKEN"


@click.group(invoke_without_command=True)
@click.option("--agents", "agents_file", type=click.Path(path_type=Path, dir_okay=False), envvar="PROOFLINE_GATEWAY_AGENTS_FILE",
              required=False, help="the agents file (PROOFLINE_GATEWAY_AGENTS_FILE)")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8765, show_default=True, type=int, help="0: any free port (see --port-file)")
@click.option("--port-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="write the bound port here once listening")
@click.option("--wait", "wait_seconds", default=60.0, show_default=True, envvar="PROOFLINE_GATEWAY_WAIT_SECONDS",
              help="how long a call waits for the proven outcome before answering with the action id")
@click.option("--console-url", default=None, envvar="PROOFLINE_GATEWAY_CONSOLE_URL",
              help="the console's base URL, for links in answers")
@click.option("--stdio", is_flag=True,
              help="serve one agent on stdin/stdout instead of HTTP: the agent whose token PROOFLINE_GATEWAY_TOKEN "
                   "holds (for an MCP client that starts the gateway itself)")
@click.pass_context
def gateway(ctx: click.Context, agents_file: Path | None, host: str, port: int, port_file: Path | None,
            wait_seconds: float, console_url: str | None, stdio: bool) -> None:
    """Serve the governed action types as MCP tools over streamable HTTP at /mcp (or, with --stdio,
    over stdin and stdout): each agent (a bearer token in the agents file) sees the action types it
    may use, and each call is published through the controller path and answered with its proven
    outcome."""
    if ctx.invoked_subcommand is not None:
        return
    if agents_file is None:
        raise click.UsageError("give --agents or PROOFLINE_GATEWAY_AGENTS_FILE")
    from proofline.errors import ConfigurationError
    from proofline.gateway.agents import load_agents
    from proofline.gateway.server import Gateway, build_app

    agents = load_agents(agents_file)  # a broken agents file is refused now, not at the first request
    if stdio:
        _serve_stdio(Gateway(settings(), agents_file, wait_seconds, console_url, token=_stdio_token(agents)))
        return
    import uvicorn

    from proofline.listen import listening_socket

    try:
        sock = listening_socket(host, port)
    except OSError as exc:
        raise ConfigurationError(f"the gateway cannot listen on {host}:{port}: {exc.strerror or exc}",
                                 host=host, port=port) from None
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(sock.getsockname()[1]))
        tmp.replace(port_file)
    app = build_app(Gateway(settings(), agents_file, wait_seconds, console_url), host)
    config = uvicorn.Config(app, log_level="warning", access_log=False, proxy_headers=False, server_header=False)
    uvicorn.Server(config).run(sockets=[sock])


def _stdio_token(agents: dict[str, Any]) -> str:
    """The agent's token from the environment, refused now (exit, nothing served) when no agent has it."""
    from proofline.errors import ConfigurationError
    from proofline.gateway.agents import authenticate

    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ConfigurationError(f"--stdio serves the agent whose token {TOKEN_ENV} holds: it is not set",
                                 variable=TOKEN_ENV)
    if authenticate(agents, f"Bearer {token}") is None:
        raise ConfigurationError(f"{TOKEN_ENV} is not the token of any agent in the agents file",
                                 variable=TOKEN_ENV)
    return token


def _serve_stdio(gateway: Any) -> None:
    import anyio

    from proofline.gateway.server import serve_stdio

    anyio.run(serve_stdio, gateway)


@gateway.command("token")
@click.argument("agent")
def gateway_token(agent: str) -> None:
    """Make a bearer token for AGENT: the token (shown once, give it to the agent) and the
    ``token_sha256`` line for the agents file."""
    from proofline.gateway.agents import new_token

    token, digest = new_token()
    emit({"agent": agent, "token": token, "token_sha256": digest},
         f"token (give it to {agent}; it is not shown again): {token}\nagents file:  token_sha256: {digest}")


COMMANDS = [gateway]
