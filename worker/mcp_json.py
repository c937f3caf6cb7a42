"""The ``mcpServers`` JSON that MCP clients read, as servers-file entries.

Claude Desktop, Cursor and most agent frameworks describe their servers as ``{"mcpServers": {NAME:
{"command", "args", "env"} | {"url", "headers", "type"}}}`` (VS Code's ``.vscode/mcp.json`` uses
``"servers"`` with the same entries). ``proofline servers import FILE`` turns such a file into
``servers.yaml`` entries, and a servers file may name such files under ``import_mcp_json:`` to
use them as they are.

What a client file does not say, the conversion decides the safe way and lists for review:

- stdio servers run **sandboxed** (no network, only declared paths): an argument or a variable
  that is an existing path becomes a read-only path (a file's folder), to be made writable if the
  server writes there; a
  launcher that downloads its package (``npx``, ``uvx``, ``pipx run``, ``bunx``) needs the network
  at first start and is flagged.
- the read identity verification uses is the same command under another uid, its paths read-only;
- environment values are **not copied** into the servers file when their names look like secrets:
  they become ``${NAME}`` references the worker's environment must provide;
- HTTP headers are credentials: an import writes each value to a file of its own (0600) and the
  entry reads it from there (``headers_from_files``). A servers file that imports a client file
  directly refuses headers (their values would stay in a file every reader of the config sees).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proofline.errors import ConfigurationError

#: Launchers that fetch the server's package from a registry when it is not installed.
DOWNLOADERS = {"npx", "uvx", "bunx", "pnpx", "pipx"}
#: Environment names whose values are taken for secrets (matched in upper case).
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|PRIVATE|CREDENTIAL|AUTH|SESSION|COOKIE|DSN)")
#: The uid a read identity runs under (the servers file's convention for readers).
READER_UID = 65533
_NAME = re.compile(r"[^A-Za-z0-9_-]+")


@dataclass
class Imported:
    """The servers-file entries made from one client file, and what a person should look at."""

    servers: dict[str, dict[str, Any]] = field(default_factory=dict)
    review: list[str] = field(default_factory=list)
    #: Secret files to write: path -> value (only when importing, never when loading).
    secrets: dict[Path, str] = field(default_factory=dict)


def read_client_file(path: Path) -> dict[str, dict[str, Any]]:
    """The server entries of a client's JSON file (``mcpServers``, or VS Code's ``servers``)."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigurationError(f"MCP client file {path} does not exist", file=str(path)) from None
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"MCP client file {path} line {exc.lineno}, column {exc.colno}: not valid JSON "
                                 f"({exc.msg})", file=str(path), line=exc.lineno) from None
    entries = raw.get("mcpServers", raw.get("servers")) if isinstance(raw, dict) else None
    if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
        raise ConfigurationError(f"MCP client file {path}: expected an object with an 'mcpServers' (or 'servers') "
                                 "object of server entries", file=str(path))
    return entries


def convert(path: Path, secrets_dir: Path | None = None) -> Imported:
    """Servers-file entries for every server in the client file at ``path``. With ``secrets_dir``
    header values are to be written there (an import); without it headers are refused (a load)."""
    out = Imported()
    for raw_name, entry in read_client_file(path).items():
        name = _NAME.sub("-", raw_name).strip("-") or "server"
        if entry.get("disabled") is True:
            out.review.append(f"{name}: disabled in {path.name}; not imported")
            continue
        where = f"{path}: server {raw_name!r}"
        if "url" in entry:
            out.servers[name] = _remote(name, entry, where, secrets_dir, out)
        elif "command" in entry:
            out.servers[name] = _local(name, entry, where, Path(path).resolve().parent, out)
        else:
            raise ConfigurationError(f"{where}: neither a 'command' nor a 'url'", file=str(path), server=raw_name)
    return out


def _remote(name: str, entry: dict[str, Any], where: str, secrets_dir: Path | None, out: Imported) -> dict[str, Any]:
    kind = str(entry.get("type", "http")).lower()
    if kind == "sse":
        raise ConfigurationError(f"{where}: the HTTP+SSE transport is not supported; streamable HTTP only",
                                 server=name)
    spec: dict[str, Any] = {"transport": "http", "url": str(entry["url"])}
    headers = entry.get("headers") or {}
    if headers:
        if secrets_dir is None:
            raise ConfigurationError(f"{where}: headers carry credentials and are not read from a client file; "
                                     "run `proofline servers import` to move them into secret files", server=name)
        files = {}
        for header, value in headers.items():
            secret = secrets_dir / f"{name}.{_NAME.sub('-', header).lower()}"
            out.secrets[secret] = str(value)
            files[header] = str(secret)
        spec["headers_from_files"] = files
        out.review.append(f"{name}: headers {', '.join(sorted(headers))} written to secret files under "
                          f"{secrets_dir} (0600); give the read identity its own read-only credential")
    # The same URL and no credential: verification must not read with the writer's token.
    spec["read_identity"] = {}
    out.review.append(f"{name}: the read identity reaches the same URL without credentials; give it a read-only one")
    return spec


def _local(name: str, entry: dict[str, Any], where: str, base: Path, out: Imported) -> dict[str, Any]:
    command = [str(entry["command"]), *[str(a) for a in entry.get("args") or []]]
    env: dict[str, str] = {}
    allow: list[str] = []
    for key, value in (entry.get("env") or {}).items():
        if SECRET_NAME.search(key.upper()):
            allow.append(key)  # taken from the worker's environment at start, never written down
            out.review.append(f"{name}: {key} looks like a secret: not copied; the worker's environment must set it")
        else:
            env[key] = str(value)
    if entry.get("envFile"):
        out.review.append(f"{name}: envFile {entry['envFile']} is not read; set its variables for the worker")
    paths = [a for a in command[1:] if os.path.isabs(a) and os.path.exists(a)]
    # A variable naming an existing file or folder (a database, a workspace) is a path the server uses.
    for value in env.values():
        if os.path.isabs(value) and os.path.exists(value):
            folder = value if os.path.isdir(value) else os.path.dirname(value)
            if folder not in paths:
                paths.append(folder)
    program = Path(command[0]).name
    spec: dict[str, Any] = {"transport": "stdio", "command": command}
    if shutil.which(command[0]) is None and not os.path.exists(command[0]):
        out.review.append(f"{name}: {command[0]} is not on this machine's PATH")
    if env:
        spec["env"] = env
    if allow:
        spec["env_allow"] = allow
    if entry.get("cwd"):
        spec["cwd"] = str(entry["cwd"])
    sandbox: dict[str, Any] = {}
    if paths:
        sandbox["ro_paths"] = paths
        out.review.append(f"{name}: {', '.join(paths)} bound read-only (from its arguments and variables); "
                          "move to rw_paths what the server writes")
    if program in DOWNLOADERS:
        out.review.append(f"{name}: {program} downloads its package at first start, and the sandbox has no "
                          "network: install the package and call it directly, or set sandbox.network: true")
    if sandbox:
        spec["sandbox"] = sandbox
    spec["read_identity"] = {"sandbox": {"uid": READER_UID, **({"ro_paths": paths} if paths else {})}}
    return spec


def write_secrets(secrets: dict[Path, str]) -> None:
    """Write each secret to its file, readable by its owner only (created 0600, never wider)."""
    for path, value in secrets.items():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value)
        os.chmod(path, 0o600)
