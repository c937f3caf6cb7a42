"""What ``mcp.Client`` connects to for one endpoint of the servers file.

A stdio endpoint becomes the launch of its server, sandboxed by bubblewrap (worker/sandbox.py) and
audited under strace when asked (worker/sandbox_reader.py), read through a transport that bounds
every message (worker/bounded_stdio.py); an HTTP endpoint becomes its URL, or a transport that
carries the identity's credentials and says which connections it holds open (for the tool-list
cache). Used by the pool processes' sessions (worker/mcp_client.py) and by the node's session host
(worker/session_host.py), which launch stdio servers the same way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
from mcp import StdioServerParameters
from mcp.client.stdio import stdio_client

from proofline.errors import McpUnavailable
from worker.bounded_stdio import bounded_stdio_client
from worker.sandbox_egress import Forwarder
from worker.sandbox_reader import Auditor
from worker.server_stderr import errlog_for
from worker.servers import Endpoint
from worker.stdio_launch import stdio_launch


def endpoint_target(endpoint: Endpoint, base_dir: Path, *, name: str = "?", role: str = "write",
                    environment: str = "development", status_path: str | None = None,
                    max_message_bytes: int | None = None, audit: Auditor | None = None,
                    watch: Callable[[WatchedTransport], None] | None = None,
                    egress: Forwarder | None = None, auth: Any = None) -> Any:
    """What ``mcp.Client`` connects to: a URL (or a transport carrying the identity's credentials, or
    one whose connection pool is handed to ``watch`` for the tool-list cache), or a stdio command, sandboxed
    unless the servers file disables it with a reason, read through a transport that bounds every
    message to ``max_message_bytes`` when given. A sandbox with an egress allowlist reaches its
    destinations through ``egress`` (without one it has no network). ``auth`` is the identity's
    OAuth provider (worker/oauth.py), which the HTTP client authenticates every request with."""
    if endpoint.transport == "http":
        if endpoint.headers_from_files or endpoint.client_cert_file or endpoint.ca_file or watch is not None \
                or auth is not None:
            return _http_transport(endpoint, watch, auth)
        return endpoint.url
    launch = stdio_launch(endpoint, base_dir, name=name, role=role, environment=environment,
                          status_path=status_path, audit=audit, egress=egress)
    # The SDK merges a few of the worker's variables (HOME, PATH, ...) under this env: the same ones
    # the session host merges (worker/stdio_launch.py), pinned by a sandboxed launch's own.
    return _bounded(StdioServerParameters(command=launch.command, args=launch.args, env=launch.env, cwd=launch.cwd),
                    max_message_bytes, errlog_for(name, role))


def _bounded(params: StdioServerParameters, max_message_bytes: int | None, errlog: Any) -> Any:
    # The server's stderr goes through worker/server_stderr.py (one warning for a known flood).
    return params if max_message_bytes is None else bounded_stdio_client(params, max_message_bytes, errlog=errlog)


def connectable(target: Any, name: str, role: str) -> Any:
    """What ``mcp.Client`` is given for ``target``: stdio parameters become a stdio transport whose
    stderr goes through worker/server_stderr.py; anything else is used as it is."""
    if isinstance(target, StdioServerParameters):
        return stdio_client(target, errlog=errlog_for(name, role))
    return target


def _read_secret(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise McpUnavailable(f"cannot read the credential file {path}: {exc.strerror}") from None


class WatchedTransport(httpx2.AsyncHTTPTransport):
    """An HTTP transport that can say which connections it holds open, for the tool-list cache."""

    def open_connections(self) -> frozenset[Any]:
        """The pool's connections when every one is still usable; empty when any was closed or the
        server ended it (end-of-file on an idle keep-alive connection, as when the server restarts)."""
        held = list(self._pool.connections)
        if any(ended(c) for c in held):
            return frozenset()
        return frozenset(held)


def ended(connection: Any) -> bool:
    """Whether a pooled connection can no longer carry a request as it is: closed, past its
    keep-alive, or idle with a readable socket (the only thing an idle HTTP/1.1 connection can read
    is the end-of-file of a server that closed it).

    The last check is made here, not left to ``has_expired()``: httpcore2 up to 2.16 counted a
    readable idle socket as expired, 2.17 only closes such a connection when the next request is
    about to use it, so a restarted server went unnoticed until that request had been sent over a
    fresh connection (after the cached tool list had already been trusted)."""
    if connection.is_closed() or connection.has_expired():
        return True
    if not connection.is_idle():
        return False
    # AsyncHTTPConnection wraps the HTTP/1.1 or HTTP/2 connection that owns the network stream.
    stream = getattr(getattr(connection, "_connection", connection), "_network_stream", None)
    if stream is None:
        # A layout this check does not know (another httpcore2): it cannot tell, so the cached tool
        # list is not trusted (one tools/list more per action), rather than trusted unchecked.
        return True
    return bool(stream.get_extra_info("is_readable"))


def _http_transport(endpoint: Endpoint, watch: Callable[[WatchedTransport], None] | None = None,
                    auth: Any = None) -> Any:
    """A streamable-HTTP transport whose client sends this identity's headers (and client
    certificate), read from their files at each connect so a rotated secret is picked up; its
    connection pool is handed to ``watch`` when given."""
    import ssl

    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT

    headers = {name: _read_secret(path) for name, path in endpoint.headers_from_files.items()}
    verify: ssl.SSLContext | bool = True
    if endpoint.ca_file or endpoint.client_cert_file:
        verify = ssl.create_default_context(cafile=endpoint.ca_file)
        if endpoint.client_cert_file and endpoint.client_key_file:
            try:
                verify.load_cert_chain(endpoint.client_cert_file, endpoint.client_key_file)
            except OSError as exc:
                raise McpUnavailable(f"cannot load the client certificate: {exc.strerror}") from None
    credentialed = bool(headers) or verify is not True or auth is not None

    @asynccontextmanager
    async def transport() -> AsyncIterator[Any]:
        # The transport carries the TLS settings (a client given a transport ignores its own).
        pool = WatchedTransport(verify=verify, trust_env=not credentialed)
        if watch is not None:
            watch(pool)
        async with httpx2.AsyncClient(
            headers=headers, transport=pool, trust_env=not credentialed, auth=auth,
            timeout=httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT),
        ) as http:
            async with streamable_http_client(endpoint.url or "", http_client=http) as streams:
                yield streams

    return transport()
