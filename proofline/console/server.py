"""Serving the console: uvicorn on a socket this module binds itself, so ``--port 0`` gets a free
port and the port can be written to a file before the first request (how tests and scripts find it).
Bound to 127.0.0.1 unless told otherwise."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import uvicorn

from proofline.console.access import Sessions, load_users
from proofline.console.app import create_app
from proofline.console.approvers import approver_keys
from proofline.errors import ConfigurationError
from proofline.listen import listening_socket


def operator_role() -> str:
    """The role writes will run as, asked of Postgres once at start (shown on the overview)."""
    from proofline.commands.base import connect
    from proofline.errors import ProoflineError

    try:
        with connect("operator") as conn, conn.cursor() as cur:
            cur.execute("SELECT current_user AS role")
            return cur.fetchone()["role"]
    except ProoflineError as exc:
        return f"unknown ({exc.code} at start)"


def serve(host: str, port: int, users_file: Path, port_file: Path | None = None,
          on_ready: Callable[[str, int], None] | None = None) -> None:
    """Serve until interrupted. The users file is read once, before the socket opens, and every
    approver user's key is checked against the keyring then (``configuration_error`` if not usable)."""
    from proofline.commands.base import settings

    users = load_users(users_file)
    approvers = approver_keys(users, settings())
    sessions = Sessions(users)
    try:
        sock = listening_socket(host, port)
    except OSError as exc:
        # A port another process holds, or an address this host does not have: the setting is wrong.
        raise ConfigurationError(f"the console cannot listen on {host}:{port}: {exc.strerror or exc}; choose "
                                 "another with --port or PROOFLINE_CONSOLE_PORT (--host, PROOFLINE_CONSOLE_HOST)",
                                 host=host, port=port) from None
    bound = sock.getsockname()[1]
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(bound))
        tmp.replace(port_file)
    if on_ready is not None:
        on_ready(host, bound)
    config = uvicorn.Config(create_app(sessions, operator_role(), approvers), log_level="warning", access_log=False, proxy_headers=False,
                            server_header=False)
    uvicorn.Server(config).run(sockets=[sock])
