"""``proofline servers login NAME``: an operator consents, once, to an identity acting for them.

The identity's ``auth:`` block names ``grant: refresh_token``. The login runs the SDK's
authorization-code flow with PKCE (``mcp.client.auth.OAuthClientProvider``) against the server
itself: its first request is refused (401), the provider discovers the authorization server from the
protected resource metadata, and the authorization URL is printed for the operator to open. The
authorization server sends the browser back to a listener on a loopback port (RFC 8252), the code
is exchanged for tokens (with the server's URL as the resource, RFC 8707), and the refresh token is
written to the identity's secret file, 0600 (default ``secrets/oauth-<server>-<role>.refresh`` in
the state folder). The worker then uses that refresh token (worker/oauth.py); nothing of it is printed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import anyio
from mcp import Client
from mcp.client.auth import OAuthClientProvider
from mcp.shared.auth import (
    AuthorizationCodeResult,
    OAuthClientInformationFull,
    OAuthClientMetadata,
    OAuthToken,
)

from proofline.errors import ConfigurationError, ServerAuthFailed
from worker.oauth import read_secret_file, refresh_token_path, write_secret_file
from worker.servers import Endpoint, Server

#: How long the listener waits for the operator's browser to come back.
LOGIN_TIMEOUT_SECONDS = 300.0


class _Callback(HTTPServer):
    """The loopback redirect listener: keeps the first ``/callback`` query it is sent."""

    def __init__(self, port: int) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.query: dict[str, list[str]] | None = None
        self.arrived = threading.Event()


class _Handler(BaseHTTPRequestHandler):
    server: _Callback

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        parts = urlparse(self.path)
        if parts.path != "/callback" or self.server.arrived.is_set():
            self.send_error(404)
            return
        self.server.query = parse_qs(parts.query)
        self.server.arrived.set()
        body = b"Proofline received the authorization. You may close this window.\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the query holds the code: not logged
        return


class _LoginStorage:
    """The SDK's ``TokenStorage`` for one login: the pre-registered client, tokens written to the file."""

    def __init__(self, client: OAuthClientInformationFull, path: Path) -> None:
        self.client, self.path = client, path
        self.stored = False

    async def get_tokens(self) -> OAuthToken | None:
        return None

    async def set_tokens(self, tokens: OAuthToken) -> None:
        if not tokens.refresh_token:
            raise ServerAuthFailed("the authorization server issued no refresh token for this client")
        write_secret_file(self.path, tokens.refresh_token)
        self.stored = True

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client = client_info


def identity_to_log_in(server: Server, role: str) -> Endpoint:
    endpoint = server.write if role == "write" else server.read
    if endpoint.transport != "http" or endpoint.auth is None or endpoint.auth.grant != "refresh_token":
        raise ConfigurationError(f"server {server.name}: the {role} identity has no `auth: {{type: oauth, grant: "
                                 f"refresh_token}}` block to log in with", server=server.name)
    return endpoint


def login(server: Server, role: str, state_dir: Path, show: Callable[[str], None],
          timeout: float = LOGIN_TIMEOUT_SECONDS) -> Path:
    """Run the consent flow for ``server``'s ``role`` identity; returns the refresh token's file."""
    endpoint = identity_to_log_in(server, role)
    assert endpoint.auth is not None
    path = refresh_token_path(endpoint.auth, server.name, role, state_dir)
    return anyio.run(_login, endpoint, path, show, timeout)


async def _login(endpoint: Endpoint, path: Path, show: Callable[[str], None], timeout: float) -> Path:
    from worker.connect import _http_transport

    spec = endpoint.auth
    assert spec is not None and endpoint.url
    listener = _Callback(spec.redirect_port)
    thread = threading.Thread(target=listener.serve_forever, name="oauth-login-callback", daemon=True)
    thread.start()
    try:
        redirect = f"http://127.0.0.1:{listener.server_address[1]}/callback"
        secret = read_secret_file(spec.client_secret_file, "client secret") if spec.client_secret_file else None
        method = spec.token_endpoint_auth_method if secret else "none"
        grants = ["authorization_code", "refresh_token"]
        client = OAuthClientInformationFull(client_id=spec.client_id, client_secret=secret, redirect_uris=[redirect],
                                            grant_types=grants, token_endpoint_auth_method=method, scope=spec.scope)
        storage = _LoginStorage(client, path)

        async def redirect_handler(url: str) -> None:
            show(url)

        async def callback_handler() -> AuthorizationCodeResult:
            if not await anyio.to_thread.run_sync(listener.arrived.wait, timeout):
                raise ServerAuthFailed(f"no authorization arrived at {redirect} within {timeout:.0f}s")
            query = listener.query or {}
            if "error" in query:
                raise ServerAuthFailed(f"the authorization server refused: {query['error'][0][:100]}")
            return AuthorizationCodeResult(code=query.get("code", [""])[0], state=query.get("state", [None])[0],
                                           iss=query.get("iss", [None])[0])

        provider = OAuthClientProvider(
            endpoint.url, OAuthClientMetadata(redirect_uris=[redirect], grant_types=grants, scope=spec.scope,
                                              token_endpoint_auth_method=method, client_name="proofline"),
            storage, redirect_handler=redirect_handler, callback_handler=callback_handler)
        async with Client(_http_transport(endpoint, auth=provider)) as session:
            await session.list_tools()  # answered with the new token: the consent works for this server
        if not storage.stored:
            raise ServerAuthFailed(f"{endpoint.url} did not ask for authorization: nothing was stored")
        return path
    finally:
        listener.shutdown()
        listener.server_close()
        thread.join(timeout=5)
