"""OAuth 2.1 access tokens for remote MCP servers: one set per identity, through the SDK's
``mcp.client.auth`` providers.

An identity with an ``auth: {type: oauth}`` block (worker/servers.py) gets an :class:`Identity`,
kept by the process's sessions (worker/mcp_client.py) across reconnections. Before a session opens
and before every request the worker makes, :meth:`Identity.ensure` makes sure a token is held that
will live past the configured margin: the authorization server is found from the server's protected
resource metadata (RFC 9728) and its own metadata (RFC 8414), and a token is asked for with the
server's URL as its resource (RFC 8707), by the client-credentials grant (a service identity) or with
the refresh token an operator's ``proofline servers login`` stored (worker/oauth_login.py). A token
that cannot be had there raises :class:`~proofline.errors.ServerAuthFailed` before anything is sent.

The same provider is the HTTP client's ``auth``: it adds the token to each request, and when the
server answers 401 anyway (revoked mid-run) it fetches a new token once and sends the request again
(the SDK's flow); if that fails too, the 401 reaches the MCP client as the server's error, after the
request was sent. Every token obtained is reported to ``on_event`` without its value (server,
identity, grant, expiry, scopes) and recorded by the sessions as ``oauth_token_refreshed`` on the
action in flight; a refusal as ``oauth_token_rejected``. Secret values (client secret, refresh and
access tokens) are given to the redaction policy (``ledger.redact.remember_secret``) as soon as
they are read or received.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import time
import warnings
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx2
from mcp.client.auth import OAuthClientProvider, OAuthFlowError, OAuthTokenError
from mcp.client.auth.extensions.client_credentials import ClientCredentialsOAuthProvider
from mcp.client.auth.oauth2 import OAuthContext
from mcp.client.auth.utils import (
    build_oauth_authorization_server_metadata_discovery_urls,
    build_protected_resource_metadata_discovery_urls,
    create_oauth_metadata_request,
    handle_auth_metadata_response,
    handle_protected_resource_response,
    validate_metadata_issuer,
)
from mcp.shared.auth import OAuthClientInformationFull, OAuthClientMetadata, OAuthToken
from mcp.shared.exceptions import MCPDeprecationWarning
from pydantic import AnyHttpUrl

from ledger.redact import remember_secret
from proofline.errors import ServerAuthFailed
from worker.servers import Endpoint, OAuthAuth

REFRESHED_EVENT = "oauth_token_refreshed"
REJECTED_EVENT = "oauth_token_rejected"
log = logging.getLogger(__name__)
Report = Callable[[str, dict[str, Any]], None]


def read_secret_file(path: str | Path, what: str) -> str:
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise ServerAuthFailed(f"cannot read the {what} file {path}: {exc.strerror}", file=str(path)) from None
    if not value:
        raise ServerAuthFailed(f"the {what} file {path} is empty", file=str(path))
    remember_secret(value)
    return value


def refresh_token_path(spec: OAuthAuth, server: str, role: str, state_dir: Path) -> Path:
    """Where the identity's refresh token lives: the configured file, else the state folder's secrets."""
    if spec.refresh_token_file:
        return Path(spec.refresh_token_file)
    return Path(state_dir) / "secrets" / f"oauth-{server}-{role}.refresh"


def write_secret_file(path: Path, value: str) -> None:
    """Write ``value`` to ``path`` readable by its owner only (0600 from the first byte), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    os.replace(tmp, path)


@dataclasses.dataclass
class _MarginContext(OAuthContext):
    """The SDK's context, with a token counted as expired ``margin`` seconds early."""

    margin: float = 0.0

    def is_token_valid(self) -> bool:
        tokens = self.current_tokens
        if not (tokens and tokens.access_token):
            return False
        return self.token_expiry_time is None or time.time() <= self.token_expiry_time - self.margin


class _Storage:
    """The SDK's ``TokenStorage``: tokens in memory, a refresh token read from (and rotated into) its
    file; every token set is reported."""

    def __init__(self, identity: Identity, client_info: OAuthClientInformationFull | None) -> None:
        self.identity = identity
        self.client_info = client_info
        self.tokens: OAuthToken | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.identity.received(tokens)
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client_info

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client_info = client_info


class _Governed:
    """What both providers add to the SDK's: discovery ahead of the first request, an early fetch, a
    flow that reports a refusal and never raises into the transport."""

    context: OAuthContext
    identity: Identity

    def _govern(self, identity: Identity, margin: float) -> None:
        self.identity = identity
        values = {f.name: getattr(self.context, f.name) for f in dataclasses.fields(OAuthContext)}
        self.context = _MarginContext(**values, margin=margin)

    async def discover(self, http: httpx2.AsyncClient) -> None:
        """The protected resource's metadata, then its authorization server's (once per identity)."""
        ctx = self.context
        if ctx.oauth_metadata is not None:
            return
        for url in build_protected_resource_metadata_discovery_urls(None, ctx.server_url):
            prm = await handle_protected_resource_response(await http.send(create_oauth_metadata_request(url)))
            if prm is not None:
                await self._validate_resource_match(prm)  # type: ignore[attr-defined]
                ctx.protected_resource_metadata = prm
                ctx.auth_server_url = self._select_authorization_server(  # type: ignore[attr-defined]
                    [str(u) for u in prm.authorization_servers])
                break
        else:
            raise ServerAuthFailed(f"{ctx.server_url} publishes no protected resource metadata")
        for url in build_oauth_authorization_server_metadata_discovery_urls(ctx.auth_server_url, ctx.server_url):
            ok, found = await handle_auth_metadata_response(await http.send(create_oauth_metadata_request(url)))
            if not ok:
                break
            if found is not None:
                validate_metadata_issuer(found, self._expected_issuer())  # type: ignore[attr-defined]
                ctx.oauth_metadata = found
                return
        raise ServerAuthFailed(f"no authorization server metadata for {ctx.auth_server_url}")

    #: A new token now (the grant's own request), or ServerAuthFailed: each grant class defines it
    #: (``_ClientCredentials``, ``_StoredRefresh``); the mixin only calls it.
    fetch: Callable[[httpx2.AsyncClient], Awaitable[None]]

    async def _auth_flow(self, request: httpx2.Request) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        carried = self.identity.carrying
        if carried is not None:
            # An action's exchanged token (worker/token_exchange.py): sent as it is, never replaced on
            # a 401 (the request was sent; what it did is for recovery to read).
            request.headers["Authorization"] = f"Bearer {carried.token}"
            response = yield request
            if response.status_code in (401, 403):
                self.identity.report(REJECTED_EVENT, {"status": response.status_code, "exchanged": True})
            return
        flow = super()._auth_flow(request)  # type: ignore[misc]
        refused = 0
        try:
            outgoing = await flow.__anext__()
            while True:
                response = yield outgoing
                if outgoing is request and response.status_code == 401:
                    refused += 1
                    self.identity.reason = "rejected"
                outgoing = await flow.asend(response)
        except StopAsyncIteration:
            pass
        except (OAuthFlowError, OAuthTokenError, httpx2.HTTPError, ServerAuthFailed) as exc:
            # The request was sent and refused; its 401 (or the token endpoint's answer) is what the
            # transport gets back. Raising here would end the transport's writer instead.
            self.identity.report(REJECTED_EVENT, {"refetch_failed": type(exc).__name__, "status": 401})
            return
        finally:
            self.identity.reason = "expiring"
        if refused:
            self.identity.report(REJECTED_EVENT, {"status": 401, "refetched": True, "accepted": refused == 1})


class _ClientCredentials(_Governed, ClientCredentialsOAuthProvider):
    def _reload_secret(self) -> None:
        # Read at every fetch: a secret rotated in its file is used from the next token on.
        spec = self.identity.spec
        secret = read_secret_file(spec.client_secret_file, "client secret") if spec.client_secret_file else None
        self._fixed_client_info = self._fixed_client_info.model_copy(update={"client_secret": secret})
        self.context.client_info = self._fixed_client_info

    async def _perform_authorization(self) -> httpx2.Request:
        self._reload_secret()
        return await super()._perform_authorization()

    async def fetch(self, http: httpx2.AsyncClient) -> None:
        self._reload_secret()
        response = await http.send(await self._exchange_token_client_credentials())
        try:
            await self._handle_token_response(response)
        except OAuthTokenError as exc:
            raise ServerAuthFailed(f"the authorization server refused the client credentials: "
                                   f"HTTP {response.status_code} {_oauth_error(response)}") from exc


class _StoredRefresh(_Governed, OAuthClientProvider):
    async def _perform_authorization(self) -> httpx2.Request:
        # A worker cannot ask a person: a 401 is answered with the stored refresh token, or not at all.
        await self.identity.load_refresh_token(self)
        return await self._refresh_token()

    async def fetch(self, http: httpx2.AsyncClient) -> None:
        path = self.identity.refresh_file
        assert path is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        # One refresh at a time across the worker's processes: a rotated refresh token is written
        # back under the same lock, and the next one to hold it reads the new one.
        lock_fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            await anyio.to_thread.run_sync(fcntl.flock, lock_fd, fcntl.LOCK_EX)
            await self.identity.load_refresh_token(self)
            response = await http.send(await self._refresh_token())
            if not await self._handle_refresh_response(response):
                raise ServerAuthFailed(f"the authorization server refused the stored refresh token "
                                       f"(HTTP {response.status_code}); run `proofline servers login`")
        finally:
            os.close(lock_fd)  # closing the descriptor releases the lock


def _oauth_error(response: httpx2.Response) -> str:
    """The ``error`` and ``error_description`` of an OAuth error answer (RFC 6749 §5.2), bounded."""
    try:
        body = response.json()
    except ValueError:
        return ""
    if not isinstance(body, dict):
        return ""
    return f"{str(body.get('error', ''))[:64]}: {str(body.get('error_description', ''))[:200]}"


def _issuer(value: str | None) -> str | None:
    """An issuer as metadata renders it (``http://host:port/`` for a root issuer), so the two compare equal."""
    return str(AnyHttpUrl(value)) if value else None


class Identity:
    """One identity's OAuth state in this process: provider, metadata and token cache."""

    def __init__(self, server: str, role: str, endpoint: Endpoint, state_dir: Path, report: Report) -> None:
        assert endpoint.auth is not None and endpoint.url
        self.server, self.role, self.spec = server, role, endpoint.auth
        self._report = report
        self.endpoint = endpoint
        #: Why the next token is fetched: none held yet, the one held is expiring, or it was refused.
        self.reason = "first"
        #: The action's exchanged token while its call runs (worker/token_exchange.py), else None.
        self.carrying: Any = None
        self.grant = self.spec.grant
        self.refresh_file = refresh_token_path(self.spec, server, role, state_dir) \
            if self.spec.grant == "refresh_token" else None
        self._http: httpx2.AsyncClient | None = None
        secret = read_secret_file(self.spec.client_secret_file, "client secret") if self.spec.client_secret_file \
            else None
        if self.spec.grant == "client_credentials":
            method = self.spec.token_endpoint_auth_method
            with warnings.catch_warnings():
                # Without an issuer the SDK warns that discovery picks the server; that is this
                # block's documented choice (set ``issuer`` to pin it).
                warnings.simplefilter("ignore", MCPDeprecationWarning)
                self.provider: Any = _ClientCredentials(
                    endpoint.url, _Storage(self, None), self.spec.client_id, secret or "",
                    token_endpoint_auth_method=method if method != "none" else "client_secret_basic",
                    scope=self.spec.scope, issuer=_issuer(self.spec.issuer))
        else:
            info = OAuthClientInformationFull(
                client_id=self.spec.client_id, client_secret=secret, redirect_uris=None, scope=self.spec.scope,
                grant_types=["authorization_code", "refresh_token"],
                token_endpoint_auth_method=self.spec.token_endpoint_auth_method if secret else "none")
            self.provider = _StoredRefresh(
                endpoint.url, OAuthClientMetadata(redirect_uris=None, scope=self.spec.scope,
                                                  grant_types=["authorization_code", "refresh_token"]),
                _Storage(self, info))
        self.provider._govern(self, self.spec.refresh_margin_seconds)

    def client_secret(self) -> str | None:
        """The client secret, read from its file now (a rotated one is used at once)."""
        path = self.spec.client_secret_file
        return read_secret_file(path, "client secret") if path else None

    def report(self, event: str, body: dict[str, Any]) -> None:
        self._report(event, {"server": self.server, "identity": self.role, **body})

    def received(self, tokens: OAuthToken) -> None:
        """A token arrived (never recorded with its value)."""
        remember_secret(tokens.access_token)
        if tokens.refresh_token:
            remember_secret(tokens.refresh_token)
            if self.refresh_file is not None:
                stored = self._stored_refresh()
                if stored != tokens.refresh_token:
                    write_secret_file(self.refresh_file, tokens.refresh_token)  # the AS rotated it
        expires = int(time.time() + tokens.expires_in) if tokens.expires_in is not None else None
        self.report(REFRESHED_EVENT, {
            "grant": self.grant, "reason": self.reason,
            "expires_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires)) if expires else None,
            "expires_in": tokens.expires_in, "scopes": (tokens.scope or "").split(),
            "resource": self.provider.context.get_resource_url()})
        log.info("oauth token obtained", extra={"event": REFRESHED_EVENT, "server": self.server, "role": self.role,
                                                "expires_in": tokens.expires_in})

    def _stored_refresh(self) -> str | None:
        try:
            return self.refresh_file.read_text().strip() if self.refresh_file is not None else None
        except OSError:
            return None

    async def load_refresh_token(self, provider: OAuthClientProvider) -> None:
        """Put the stored refresh token (the file's, which another process may have rotated) in the context."""
        assert self.refresh_file is not None
        value = read_secret_file(self.refresh_file, "refresh token") if self.refresh_file.exists() else None
        if value is None:
            raise ServerAuthFailed(f"{self.server}/{self.role}: no refresh token at {self.refresh_file}; an operator "
                                   f"consents with `proofline servers login {self.server}`", file=str(self.refresh_file))
        ctx = provider.context
        held = ctx.current_tokens
        if held is None or held.refresh_token != value:
            ctx.current_tokens = OAuthToken(access_token=held.access_token if held else "", refresh_token=value,
                                            expires_in=held.expires_in if held else None, scope=held.scope if held else None)
            if held is None:
                ctx.token_expiry_time = 0.0
        if ctx.client_info is None:
            ctx.client_info = await ctx.storage.get_client_info()

    def http(self) -> httpx2.AsyncClient:
        """The client discovery and token requests go through (on the sessions' event loop)."""
        if self._http is None:
            import ssl

            verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=self.endpoint.ca_file) \
                if self.endpoint.ca_file else True
            self._http = httpx2.AsyncClient(verify=verify, trust_env=False, timeout=httpx2.Timeout(10.0))
        return self._http

    async def ensure(self) -> None:
        """Hold a token that lives past the margin, fetching one now if not; ServerAuthFailed if none
        can be had (nothing was sent to the MCP server then)."""
        provider = self.provider
        async with provider.context.lock:
            if not provider._initialized:
                await provider._initialize()
            try:
                await provider.discover(self.http())
                if provider.context.is_token_valid():
                    return
                await provider.fetch(self.http())
            except ServerAuthFailed:
                raise
            except (OAuthFlowError, OAuthTokenError, httpx2.HTTPError, ValueError) as exc:
                raise ServerAuthFailed(f"{self.server}/{self.role}: no access token: {type(exc).__name__}: "
                                       f"{str(exc)[:200]}") from None
            finally:
                self.reason = "expiring"
            if not provider.context.is_token_valid():
                raise ServerAuthFailed(f"{self.server}/{self.role}: the token issued lives less than the "
                                       f"{self.spec.refresh_margin_seconds}s margin")

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
