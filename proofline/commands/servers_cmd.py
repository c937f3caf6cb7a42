"""``proofline servers``: the servers file, and what MCP clients already describe."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import yaml

from proofline.commands.base import emit, settings
from proofline.commands.exit_codes import CHECK_FAILED


@click.group()
def servers() -> None:
    """MCP servers the workers may call."""


@servers.command("import")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="servers file to add the entries to (default: PROOFLINE_SERVERS_FILE)")
@click.option("--secrets-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="where header values are written, one 0600 file each (default: secrets/ beside --out)")
@click.option("--replace", is_flag=True, help="replace entries of the same name already in the servers file")
@click.option("--dry-run", is_flag=True, help="print the entries and the review list; write nothing")
def servers_import(file: Path, out: Path | None, secrets_dir: Path | None, replace: bool, dry_run: bool) -> None:
    """Add the servers of an MCP client's JSON file (an ``mcpServers`` object, as Claude Desktop,
    Cursor and agent frameworks write it, or VS Code's ``servers``) to the servers file: stdio
    servers sandboxed, secrets kept out of it, and a list of what to review before the first run.
    Exit 1 when a name is already in the servers file (unless --replace)."""
    from worker.mcp_json import convert, write_secrets
    from worker.servers import load_servers

    out = Path(out or settings().servers_file)
    secrets_dir = Path(secrets_dir or out.resolve().parent / "secrets")
    imported = convert(file, secrets_dir)
    doc = yaml.safe_load(out.read_text()) if out.exists() else None
    doc = doc if isinstance(doc, dict) else {}
    existing = doc.setdefault("servers", {}) or {}
    clashes = sorted(set(existing) & set(imported.servers))
    if clashes and not replace:
        click.echo(f"already in {out}: {', '.join(clashes)} (use --replace)", err=True)
        sys.exit(CHECK_FAILED)
    existing.update(imported.servers)
    doc["servers"] = existing
    text = yaml.safe_dump(doc, sort_keys=False)
    if not dry_run:
        write_secrets(imported.secrets)
        out.write_text(text)
        load_servers.cache_clear()
        load_servers(out)  # what was written loads: a mistake here is reported now, not at worker start
    emit({"servers": imported.servers, "review": imported.review, "written": None if dry_run else str(out)},
         lambda: "\n".join([*(f"imported  {name}" for name in imported.servers),
                            *(f"review  {line}" for line in imported.review),
                            text.rstrip() if dry_run else f"wrote {out}"]))


@servers.command("login")
@click.argument("name")
@click.option("--role", type=click.Choice(["write", "read"]), default="write", show_default=True,
              help="which identity of the server consents")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="seconds to wait for the browser to come back to the loopback listener")
def servers_login(name: str, role: str, timeout: float) -> None:
    """Consent to an OAuth identity (authorization code with PKCE): prints the authorization URL,
    receives the code on a loopback redirect listener and stores the refresh token, 0600, in the
    identity's secret file (default: secrets/ in the state folder). The identity's ``auth:`` block
    must name ``grant: refresh_token``; the worker then uses the stored refresh token."""
    from worker.oauth_login import login
    from worker.servers import server_named

    s = settings()
    server = server_named(Path(s.servers_file), name)
    path = login(server, role, Path(s.state_dir),
                 lambda url: click.echo(f"Open this URL to authorize {name} ({role}):\n{url}", err=True),
                 timeout=timeout)
    emit({"server": name, "role": role, "refresh_token_file": str(path)},
         lambda: f"stored the refresh token for {name} ({role}) in {path}")


COMMANDS = [servers]
