"""``proofline console``: the operator console (``proofline/console/``), and ``console add-user``."""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path

import click

from proofline.commands.base import emit, foreground, refuse_json, settings


def users_file(path: str | None) -> Path:
    return Path(path) if path else settings().console_users_file or Path(settings().state_dir) / "console-users.json"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@foreground
@click.group(invoke_without_command=True)
@click.option("--host", default=None, help="address to bind (default PROOFLINE_CONSOLE_HOST, 127.0.0.1)")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="port (default PROOFLINE_CONSOLE_PORT, 8470; 0 picks a free one)")
@click.option("--users", "users", default=None, help="the users file (default PROOFLINE_CONSOLE_USERS_FILE)")
@click.option("--port-file", type=click.Path(dir_okay=False), default=None,
              help="write the bound port here once listening")
@click.pass_context
def console(ctx: click.Context, host: str | None, port: int | None, users: str | None, port_file: str | None) -> None:
    """Serve the operator console: actions, evidence, runs, the manual queue, kill switches,
    revocations, proposals, approvals, the authority policy and an overview. Reads as the reader
    role, writes as the operator role; approver users' approvals are signed with their own key."""
    if ctx.invoked_subcommand is not None:
        return
    refuse_json("console")
    from proofline.console.server import serve

    s = settings()

    def ready(bound_host: str, bound_port: int) -> None:
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        click.echo(f"operator console on http://{shown}:{bound_port}/ (Ctrl-C to stop)", err=True)
        if not _loopback(bound_host):
            click.echo("proofline console: warning: listening beyond loopback with no TLS of its own; put it "
                       "behind a proxy that terminates TLS", err=True)
        sys.stderr.flush()

    serve(host or s.console_host, s.console_port if port is None else port, users_file(users),
          Path(port_file) if port_file else None, on_ready=ready)


@console.command("add-user")
@click.argument("name")
@click.option("--role", type=click.Choice(["viewer", "operator", "approver", "auditor"]), required=True)
@click.option("--approver-key", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="approvers only: the approver key file the console signs this user's approvals with")
@click.option("--users", "users", default=None, help="the users file (default PROOFLINE_CONSOLE_USERS_FILE)")
def add_user(name: str, role: str, approver_key: Path | None, users: str | None) -> None:
    """Add a console user (or give one a new token). The token is printed once and stored hashed."""
    from proofline.console.access import ConsoleRole
    from proofline.console.access import add_user as do_add

    path = users_file(users)
    if approver_key is not None:  # a file that is no approver key is refused now, not at the console's start
        from proofline.keys import KeyRole, load_signing_key

        load_signing_key(approver_key, KeyRole.approver, settings().environment)
    token = do_add(path, name, ConsoleRole(role), approver_key)
    shown = {"approver_key": str(approver_key.resolve())} if approver_key else {}
    emit({"user": name, "role": role, "token": token, "users_file": str(path), **shown},
         f"{name} ({role}) added to {path}\ntoken (shown once): {token}")


COMMANDS = (console,)
