"""The servers file: how to reach each MCP server, for writes and for independent reads.

Example (``servers.yaml``)::

    servers:
      sor:
        transport: stdio                      # or http
        command: ["{python}", "-m", "proofline_kit.sor", "--transport", "stdio"]
        env_allow: [SOR_DB]                   # copied from the worker's environment, nothing else is
        env: {SOR_ROLE: writer}
        cwd: var
        expected_version: "1.0.0"
        sandbox:                              # stdio only; on unless enabled: false (worker/sandbox.py)
          rw_paths: [var]
        read_identity:                        # a separate read-only identity for verification
          env: {SOR_ROLE: reader}
          sandbox: {uid: 65533, ro_paths: [var]}   # the same program, its data bound read-only

An HTTP endpoint may read per-identity credentials from secret files::

        headers_from_files: {Authorization: /run/secrets/sor-writer-token}
        client_cert_file: /run/secrets/sor-writer.crt   # optional mTLS
        client_key_file: /run/secrets/sor-writer.key
        ca_file: /run/secrets/sor-ca.pem                # optional: verify the server against this CA

or get OAuth 2.1 access tokens of its own (worker/oauth.py, docs/how-to/oauth-servers.md)::

        auth:
          type: oauth
          grant: client_credentials                     # or refresh_token (``proofline servers login``)
          client_id: proofline-writer
          client_secret_file: /run/secrets/sor-writer.secret
          scope: "sor:write"

The read identity inherits none of the writer's credentials and none of its writable paths.

Every string value may name environment variables of the process that reads the file as
``${NAME}`` (``$$`` is a literal ``$``); an unset one is refused (``servers_variable_unset``), never
left as text. A relative command (one with a ``/``, e.g. ``venv/bin/server``), relative sandbox
paths, ``cwd`` and relative credential files are relative to the servers file's own folder.
"""

from __future__ import annotations

import os
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from proofline.errors import ConfigurationError, ServersVariableUnset
from proofline.server_requests import ServerRequestPolicy
from worker.sandbox import SandboxSpec, reader_sandbox

#: A stdio server gets this PATH and nothing else unless the servers file allows a variable.
MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"


class TokenExchange(BaseModel):
    """A per-action token for the write call (OAuth 2.0 Token Exchange, RFC 8693): the identity's
    token is exchanged for one narrowed to the action's scope, this server as its resource, and a
    lifetime no longer than the action's remaining deadline (worker/token_exchange.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: ``always``: every write call carries an exchanged token (an authorization server that does
    #: not advertise the grant fails the call before sending); ``if_advertised``: only where the
    #: authorization server's metadata lists the grant in ``grant_types_supported``.
    use: Literal["always", "if_advertised"] = "always"
    #: Space-separated scopes the per-action token is asked for (unset: the identity's ``scope``).
    scope: str | None = None
    #: Tool name -> the scopes its calls' tokens are asked for, instead of ``scope``.
    tool_scopes: dict[str, str] = Field(default_factory=dict)
    #: The longest a per-action token may live (seconds); the action's remaining deadline shortens it.
    lifetime_seconds: int = Field(default=300, ge=1)


class OAuthAuth(BaseModel):
    """OAuth 2.1 for one identity: the authorization server is discovered from the server's protected
    resource metadata (RFC 9728), every token is asked for the server's URL as its resource (RFC 8707)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["oauth"]
    #: ``client_credentials``: a service identity with its own secret; ``refresh_token``: a refresh
    #: token an operator consented to with ``proofline servers login`` (authorization code + PKCE).
    grant: Literal["client_credentials", "refresh_token"] = "client_credentials"
    client_id: str = Field(min_length=1)
    #: The client secret, read from this file when a token is fetched (required for client_credentials;
    #: optional for a confidential client's refresh token).
    client_secret_file: str | None = None
    #: refresh_token only: where ``servers login`` stores the refresh token (0600); default
    #: ``secrets/oauth-<server>-<role>.refresh`` in the state folder.
    refresh_token_file: str | None = None
    #: Space-separated scopes to ask for (unset: what the protected resource metadata advertises).
    scope: str | None = None
    #: The authorization server the credentials belong to; discovery that leads elsewhere is refused.
    issuer: str | None = None
    token_endpoint_auth_method: Literal["client_secret_basic", "client_secret_post", "none"] = "client_secret_basic"
    #: A token is fetched again when less than this much of its life is left (seconds).
    refresh_margin_seconds: float = Field(default=30.0, ge=0)
    #: ``servers login`` only: the loopback port its redirect listener binds (0: any free port; an
    #: authorization server that registers exact redirect URIs needs a fixed one).
    redirect_port: int = Field(default=0, ge=0, le=65535)
    #: The write call's per-action token (RFC 8693); unset, every request carries this identity's token.
    token_exchange: TokenExchange | None = None

    @model_validator(mode="after")
    def _secrets(self) -> OAuthAuth:
        if self.grant == "client_credentials" and self.client_secret_file is None:
            raise ValueError("auth: the client_credentials grant needs a client_secret_file")
        if self.token_endpoint_auth_method != "none" and self.client_secret_file is None:
            if self.grant == "client_credentials" or "token_endpoint_auth_method" in self.model_fields_set:
                raise ValueError("auth: a client_secret_file is needed for " + self.token_endpoint_auth_method)
        if self.token_exchange is not None:
            self._narrower(self.token_exchange)
        return self

    def _narrower(self, exchange: TokenExchange) -> None:
        """Every scope a per-action token is asked for lies within the identity's own."""
        held = set((self.scope or "").split())
        asked = {"token_exchange.scope": exchange.scope or self.scope or "",
                 **{f"token_exchange.tool_scopes.{tool}": value for tool, value in exchange.tool_scopes.items()}}
        for where, value in asked.items():
            if not value.split():
                raise ValueError(f"auth: {where} names no scope (set token_exchange.scope or the identity's scope)")
            wider = sorted(set(value.split()) - held) if held else []
            if wider:
                raise ValueError(f"auth: {where} asks for {' '.join(wider)}, beyond the identity's scope")


class Endpoint(BaseModel):
    """One identity on one server: a stdio command line or an HTTP URL."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    transport: Literal["stdio", "http"]
    command: tuple[str, ...] = ()
    url: str | None = None
    env_allow: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    #: "auto" tries the current protocol and falls back to the initialize handshake (servers on
    #: the 1.x SDK); "legacy" always uses the handshake.
    protocol: Literal["auto", "legacy"] = "auto"
    #: stdio only: how the server is confined (on by default).
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)
    #: http only: request headers whose values are read from secret files at each connect.
    headers_from_files: dict[str, str] = Field(default_factory=dict)
    client_cert_file: str | None = None
    client_key_file: str | None = None
    ca_file: str | None = None
    #: http only: OAuth 2.1 tokens for this identity (worker/oauth.py); never inherited by the reader.
    auth: OAuthAuth | None = None

    @model_validator(mode="after")
    def _complete(self) -> Endpoint:
        if self.transport == "stdio" and not self.command:
            raise ValueError("a stdio endpoint needs a command")
        if self.transport == "http" and not self.url:
            raise ValueError("an http endpoint needs a url")
        if self.transport == "http" and "sandbox" in self.model_fields_set:
            raise ValueError("sandbox applies to stdio servers only")
        http_only = {"headers_from_files", "client_cert_file", "client_key_file", "ca_file", "auth"}
        if self.transport == "stdio" and http_only & self.model_fields_set:
            raise ValueError("headers_from_files, auth and TLS files apply to http servers only")
        if self.auth is not None and "authorization" in {h.lower() for h in self.headers_from_files}:
            raise ValueError("auth: oauth and an Authorization header from a file exclude each other")
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError("client_cert_file and client_key_file go together")
        return self

    def stdio_environment(self) -> dict[str, str]:
        """An explicit, minimal environment: no inherited credentials."""
        env = {"PATH": MINIMAL_PATH, "LANG": "C.UTF-8"}
        for name in self.env_allow:
            if name in os.environ:
                env[name] = os.environ[name]
        env.update(self.env)
        return env

    def argv(self) -> list[str]:
        return [part.replace("{python}", sys.executable) for part in self.command]

    def working_directory(self, base: Path) -> str:
        path = (base / self.cwd) if self.cwd else base
        path.mkdir(parents=True, exist_ok=True)
        return str(path)


class Server(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    write: Endpoint
    read: Endpoint
    expected_version: str | None = None
    #: Largest result this server may return (bytes); lowers the settings' limit, never raises it.
    max_result_bytes: int | None = Field(default=None, gt=0)
    #: How long the tool list may be reused for contract checks (seconds; 0: list on every action);
    #: unset: the setting ``tool_list_max_age_seconds``.
    tool_list_max_age_seconds: float | None = Field(default=None, ge=0)
    #: How elicitation, sampling and roots requests from this server are answered (refused by default).
    server_requests: ServerRequestPolicy = Field(default_factory=ServerRequestPolicy)

    @model_validator(mode="after")
    def _roots_need_a_sandbox(self) -> Server:
        if self.server_requests.roots == "sandbox":
            for role, endpoint in (("write", self.write), ("read", self.read)):
                if endpoint.transport != "stdio" or not endpoint.sandbox.enabled:
                    raise ValueError(f"server_requests.roots: sandbox needs a sandboxed stdio server "
                                     f"(the {role} identity has no sandbox to declare paths from)")
        if self.read.auth is not None and self.read.auth.token_exchange is not None:
            # Reads carry the read identity's own token (worker/token_exchange.py): refused, not ignored.
            raise ValueError("read_identity.auth.token_exchange: per-action tokens are for the write call only")
        return self


#: Never inherited by a read identity: credentials are per identity.
CREDENTIAL_FIELDS = ("headers_from_files", "client_cert_file", "client_key_file", "auth")


def _merge(base: dict, override: dict) -> dict:
    base = {k: v for k, v in base.items() if k not in CREDENTIAL_FIELDS}
    merged = {**base, **override}
    if "env" in base or "env" in override:
        merged["env"] = {**base.get("env", {}), **override.get("env", {})}
    if base.get("transport", "stdio") == "stdio" and merged.get("transport", "stdio") == "stdio":
        merged["sandbox"] = reader_sandbox(base.get("sandbox") or {}, override.get("sandbox"))
    return merged


_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: Endpoint fields holding a file path, taken relative to the servers file's folder.
FILE_FIELDS = ("client_cert_file", "client_key_file", "ca_file")
#: The same, inside an ``auth:`` block.
AUTH_FILE_FIELDS = ("client_secret_file", "refresh_token_file")


def expand(value: object, where: str, path: Path) -> object:
    """``value`` with every ``${NAME}`` replaced by the environment's value (recursively)."""
    if isinstance(value, dict):
        return {k: expand(v, f"{where}.{k}", path) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [expand(v, f"{where}[{i}]", path) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "$"
        if name not in os.environ:
            raise ServersVariableUnset(f"servers file {path}: {where} names ${{{name}}}, which is not set in this "
                                       f"process's environment", file=str(path), variable=name)
        return os.environ[name]

    return _VARIABLE.sub(substitute, value)


def anchored(spec: dict, base: Path) -> dict:
    """An endpoint block with its relative command and file paths made relative to ``base``."""
    spec = dict(spec)
    command = list(spec.get("command") or ())
    if command and isinstance(command[0], str) and "/" in command[0] and not os.path.isabs(command[0]):
        spec["command"] = [os.path.normpath(base / command[0]), *command[1:]]
    for name in FILE_FIELDS:
        if isinstance(spec.get(name), str) and not os.path.isabs(spec[name]):
            spec[name] = os.path.normpath(base / spec[name])
    auth = spec.get("auth")
    if isinstance(auth, dict):
        spec["auth"] = {k: (os.path.normpath(base / v) if k in AUTH_FILE_FIELDS and isinstance(v, str)
                            and not os.path.isabs(v) else v) for k, v in auth.items()}
    headers = spec.get("headers_from_files")
    if isinstance(headers, dict):
        spec["headers_from_files"] = {k: v if os.path.isabs(str(v)) else os.path.normpath(base / str(v))
                                      for k, v in headers.items()}
    return spec


def _parse(path: Path) -> dict[str, Any]:
    """The ``servers:`` mapping of the file, or a ConfigurationError naming the file (and the line
    and column of a YAML error): never a parser's traceback."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as exc:
        raise ConfigurationError(f"servers file {path} does not exist", file=str(path)) from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigurationError(f"servers file {path}{where}: not valid YAML ({what})", file=str(path),
                                 **({"line": mark.line + 1} if mark is not None else {})) from None
    servers = raw.get("servers") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or not isinstance(servers, dict | None):
        raise ConfigurationError(f"servers file {path}: expected a mapping with a 'servers:' mapping of server "
                                 "names", file=str(path))
    return {**_client_files(path, raw.get("import_mcp_json")), **(servers or {})}


def _client_files(path: Path, files: object) -> dict[str, Any]:
    """The entries of the MCP client files a servers file names under ``import_mcp_json:`` (its own
    entries of the same name win), converted as ``proofline servers import`` would (worker/mcp_json.py)."""
    from worker.mcp_json import convert

    if files is None:
        return {}
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ConfigurationError(f"servers file {path}: import_mcp_json must be a list of file paths", file=str(path))
    found: dict[str, Any] = {}
    for name in files:
        found.update(convert(Path(path).resolve().parent / name).servers)
    return found


def _reason(exc: ValueError) -> str:
    """A validation error as one line per problem (where, then what), without pydantic's boilerplate."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    problems = []
    for e in exc.errors():
        where, what = ".".join(str(p) for p in e["loc"]), e["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {what}" if where else what)
    return "; ".join(problems)


@lru_cache(maxsize=8)
def load_servers(path: Path) -> dict[str, Server]:
    raw = _parse(Path(path))
    base = Path(path).resolve().parent
    servers: dict[str, Server] = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict):
            raise ConfigurationError(f"server {name}: expected a mapping", server=name)
        spec = anchored(expand(spec, f"servers.{name}", Path(path)), base)
        if isinstance(spec.get("read_identity"), dict):
            spec["read_identity"] = anchored(spec["read_identity"], base)
        read_override = spec.pop("read_identity", None)
        expected = spec.pop("expected_version", None)
        max_result = spec.pop("max_result_bytes", None)
        # A server's own fields: the rest of the block is its write endpoint.
        tool_list_age = spec.pop("tool_list_max_age_seconds", None)
        requests = spec.pop("server_requests", None)
        if read_override is None:
            raise ConfigurationError(f"server {name}: a read_identity for verification is required")
        try:
            servers[name] = Server(
                name=name, write=Endpoint(**spec), read=Endpoint(**_merge(spec, read_override)),
                expected_version=expected, max_result_bytes=max_result,
                tool_list_max_age_seconds=tool_list_age,
                **({"server_requests": requests} if requests is not None else {}),
            )
        except ValueError as exc:
            raise ConfigurationError(f"servers file {path}: server {name}: {_reason(exc)}", server=name,
                                     file=str(path)) from None
    return servers


def server_named(path: Path, name: str) -> Server:
    servers = load_servers(Path(path))
    if name not in servers:
        raise ConfigurationError(f"server {name!r} is not in {path}")
    return servers[name]


def check_sandbox_policy(path: Path, environment: str) -> dict[str, str]:
    """Every stdio identity in the servers file against the sandbox rule; a production worker calls
    this at start and refuses to run when an unsandboxed server gives no reason.

    Returns the reasons of the unsandboxed (or unaudited) identities, by ``server/role``."""
    from worker.sandbox import require_audit, require_policy

    reasons = {}
    for server in load_servers(Path(path)).values():
        for role, endpoint in (("write", server.write), ("read", server.read)):
            if endpoint.transport == "stdio":
                reason = require_policy(server.name, role, endpoint.sandbox, environment)
                unaudited = require_audit(server.name, role, endpoint.sandbox, environment)
                if reason is not None:
                    reasons[f"{server.name}/{role}"] = reason
                elif unaudited is not None:
                    reasons[f"{server.name}/{role}"] = f"sandboxed, not audited: {unaudited}"
    return reasons


def sandboxed_identities(path: Path) -> list[str]:
    """``server/role`` of every stdio identity in the servers file that runs in a sandbox."""
    return [f"{s.name}/{role}" for s in load_servers(Path(path)).values()
            for role, e in (("write", s.write), ("read", s.read)) if e.transport == "stdio" and e.sandbox.enabled]
