"""The test kit's OAuth 2.1 authorization server, built on the MCP SDK's ``mcp.server.auth``.

The SDK supplies the metadata document (RFC 8414), the authorization endpoint (PKCE required), the
token endpoint for the authorization-code and refresh-token grants, and revocation (RFC 7009); this
module adds what a service identity and a resource server need: the client-credentials and
token-exchange (RFC 8693) grants on the same token endpoint, and token introspection (RFC 7662) for the resource server to check a token's
client, scopes, expiry and resource (RFC 8707) against.

Clients are pre-registered from a JSON file ``{client_id: {"secret": ..., "grant_types": [...],
"scope": "a b", "loopback": true, "auth_method": "client_secret_post"}}`` (a client with a secret
authenticates with ``client_secret_basic`` unless ``auth_method`` says otherwise); a ``loopback`` client may redirect to any port of 127.0.0.1
(RFC 8252 §7.3). Consent is automatic: ``/authorize`` answers with the redirect at once, so a test
can follow the printed URL with an HTTP client.

Test controls (loopback only, no authentication): ``POST /admin/revoke`` ``{"client_id": ...}``
revokes every token the client holds; ``GET /admin/stats`` counts the tokens issued per client and
grant; ``GET /admin/tokens`` lists every token value issued; ``POST /admin/lifetime`` ``{"access": seconds}`` changes the lifetime of tokens issued from then on; ``POST /admin/exchange``
``{"mode": "normal" | "broader" | "longer" | "refuse", "advertised": true}`` makes the token-exchange
grant misbehave, and its metadata list the grant or not.

``python -m proofline_kit.oauth --clients FILE --port-file FILE [--access-lifetime S]``
"""

from __future__ import annotations

import argparse
import base64
import hmac
import json
import os
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from mcp.server.auth.handlers.metadata import MetadataHandler
from mcp.server.auth.handlers.token import TokenHandler
from mcp.server.auth.middleware.client_auth import AuthenticationError, ClientAuthenticator
from mcp.server.auth.provider import (
    AccessToken,
    AuthorizationCode,
    AuthorizationParams,
    RefreshToken,
    construct_redirect_uri,
)
from mcp.server.auth.routes import build_metadata, create_auth_routes
from mcp.server.auth.settings import ClientRegistrationOptions, RevocationOptions
from mcp.shared.auth import InvalidRedirectUriError, OAuthClientInformationFull, OAuthToken
from pydantic import AnyHttpUrl, AnyUrl
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proofline.listen import listening_socket

METADATA_PATH = "/.well-known/oauth-authorization-server"
NO_STORE = {"Cache-Control": "no-store", "Pragma": "no-cache"}
EXCHANGE_GRANT = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"
#: How the token-exchange grant behaves (``POST /admin/exchange {"mode": ...}``): as it should; with
#: a scope broader than asked; with a lifetime longer than asked; or refusing every exchange.
EXCHANGE_MODES = frozenset({"normal", "broader", "longer", "refuse"})
#: The scope the ``broader`` mode adds when the subject token holds nothing beyond what was asked.
EXTRA_SCOPE = "sor:admin"


class LoopbackClient(OAuthClientInformationFull):
    """A native client: any port of a registered loopback redirect is the same redirect (RFC 8252)."""

    def validate_redirect_uri(self, redirect_uri: AnyUrl | None) -> AnyUrl:
        if redirect_uri is not None and redirect_uri.scheme == "http" and redirect_uri.host in ("127.0.0.1", "::1"):
            return redirect_uri
        raise InvalidRedirectUriError(f"Redirect URI '{redirect_uri}' is not a loopback address")


class KitProvider:
    """In-memory clients, codes and tokens: the SDK's ``OAuthAuthorizationServerProvider`` protocol."""

    def __init__(self, clients: dict[str, OAuthClientInformationFull], access_lifetime: float,
                 refresh_lifetime: float | None = None) -> None:
        self.clients = clients
        self.access_lifetime = access_lifetime
        self.refresh_lifetime = refresh_lifetime
        self.codes: dict[str, AuthorizationCode] = {}
        self.access: dict[str, AccessToken] = {}
        self.refresh: dict[str, RefreshToken] = {}
        #: Tokens issued, by "client_id grant".
        self.issued: Counter[str] = Counter()
        #: Every token value ever issued (revoked and expired ones too).
        self.ever: set[str] = set()
        #: The token-exchange grant's behaviour, one of EXCHANGE_MODES.
        self.exchange_mode = "normal"

    async def get_client(self, client_id: str) -> OAuthClientInformationFull | None:
        return self.clients.get(client_id)

    async def register_client(self, client_info: OAuthClientInformationFull) -> None:
        self.clients[client_info.client_id] = client_info

    async def authorize(self, client: OAuthClientInformationFull, params: AuthorizationParams) -> str:
        code = secrets.token_urlsafe(24)
        self.codes[code] = AuthorizationCode(
            code=code, scopes=params.scopes or (client.scope or "").split(), expires_at=time.time() + 120,
            client_id=client.client_id, code_challenge=params.code_challenge, redirect_uri=params.redirect_uri,
            redirect_uri_provided_explicitly=params.redirect_uri_provided_explicitly, resource=params.resource,
            subject="operator")
        return construct_redirect_uri(str(params.redirect_uri), code=code, state=params.state)

    async def load_authorization_code(self, client: OAuthClientInformationFull, code: str) -> AuthorizationCode | None:
        found = self.codes.get(code)
        return found if found is not None and found.client_id == client.client_id else None

    async def exchange_authorization_code(self, client: OAuthClientInformationFull,
                                          code: AuthorizationCode) -> OAuthToken:
        self.codes.pop(code.code, None)
        return self.issue(client.client_id, code.scopes, code.resource, "authorization_code", with_refresh=True)

    async def load_refresh_token(self, client: OAuthClientInformationFull, refresh_token: str) -> RefreshToken | None:
        found = self.refresh.get(refresh_token)
        if found is None or found.client_id != client.client_id:
            return None
        if found.expires_at is not None and found.expires_at < time.time():
            return None
        return found

    async def exchange_refresh_token(self, client: OAuthClientInformationFull, refresh_token: RefreshToken,
                                     scopes: list[str]) -> OAuthToken:
        # The refresh token is kept (not rotated): a confidential client's may be (OAuth 2.1 §4.3.1).
        token = self.issue(client.client_id, scopes, refresh_token.resource, "refresh_token")
        return token.model_copy(update={"refresh_token": refresh_token.token})

    async def load_access_token(self, token: str) -> AccessToken | None:
        found = self.access.get(token)
        if found is None or (found.expires_at is not None and found.expires_at < time.time()):
            return None
        return found

    async def revoke_token(self, token: AccessToken | RefreshToken) -> None:
        self.access.pop(token.token, None)
        self.refresh.pop(token.token, None)

    def revoke_client(self, client_id: str) -> int:
        """Revoke every token of ``client_id``; returns how many."""
        gone = [t for t, a in self.access.items() if a.client_id == client_id]
        gone += [t for t, r in self.refresh.items() if r.client_id == client_id]
        for t in gone:
            self.access.pop(t, None)
            self.refresh.pop(t, None)
        return len(gone)

    def issue(self, client_id: str, scopes: list[str], resource: str | None, grant: str,
              with_refresh: bool = False, lifetime_seconds: float | None = None) -> OAuthToken:
        now = time.time()
        value = "at-" + secrets.token_urlsafe(24)
        life = self.access_lifetime if lifetime_seconds is None else lifetime_seconds
        lifetime = max(1, int(life))
        self.access[value] = AccessToken(token=value, client_id=client_id, scopes=scopes,
                                         expires_at=int(now + life), resource=resource)
        self.issued[f"{client_id} {grant}"] += 1
        self.ever.add(value)
        refresh = None
        if with_refresh:
            refresh = "rt-" + secrets.token_urlsafe(24)
            self.ever.add(refresh)
            self.refresh[refresh] = RefreshToken(
                token=refresh, client_id=client_id, scopes=scopes, resource=resource,
                expires_at=int(now + self.refresh_lifetime) if self.refresh_lifetime else None)
        return OAuthToken(access_token=value, token_type="Bearer", expires_in=lifetime,
                          scope=" ".join(scopes) or None, refresh_token=refresh)


def load_clients(path: Path) -> dict[str, OAuthClientInformationFull]:
    clients: dict[str, OAuthClientInformationFull] = {}
    for client_id, spec in json.loads(path.read_text()).items():
        kind = LoopbackClient if spec.get("loopback") else OAuthClientInformationFull
        secret = spec.get("secret")
        clients[client_id] = kind(
            client_id=client_id, client_secret=secret, scope=spec.get("scope"),
            grant_types=spec.get("grant_types", ["client_credentials"]),
            token_endpoint_auth_method=spec.get("auth_method") or ("client_secret_basic" if secret else "none"),
            redirect_uris=[AnyUrl("http://127.0.0.1/callback")] if spec.get("loopback") else None)
    return clients


async def _basic_client(provider: KitProvider, request: Request, form: Any) -> OAuthClientInformationFull | None:
    """The client a ``client_secret_basic`` header names and proves (RFC 6749 §2.3.1), when the form
    carries no client_id (which the SDK's authenticator requires)."""
    header = request.headers.get("authorization", "")
    if form.get("client_id") or not header.startswith("Basic "):
        return None
    try:
        client_id, _, secret = base64.b64decode(header[6:]).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    client = await provider.get_client(unquote(client_id))
    if client is None or not client.client_secret or not hmac.compare_digest(unquote(secret), client.client_secret):
        return None
    return client


def _refused(error: str, description: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": error, "error_description": description}, status, NO_STORE)


async def exchange(provider: KitProvider, client: OAuthClientInformationFull, form: Any) -> Response:
    """The token-exchange grant (RFC 8693 §2): an access token of the same client, exchanged for one
    with the scope asked (within the subject token's), the same resource, and the lifetime asked in
    the ``expires_in`` extension parameter (no longer than the server's own); misbehaving as
    ``provider.exchange_mode`` says."""
    if EXCHANGE_GRANT not in (client.grant_types or []):
        return _refused("unauthorized_client", "this client may not exchange tokens")
    if provider.exchange_mode == "refuse":
        return _refused("invalid_grant", "token exchange is refused (test mode)")
    if form.get("subject_token_type") != ACCESS_TOKEN_TYPE:
        return _refused("invalid_request", "subject_token_type must be an access token")
    subject = await provider.load_access_token(str(form.get("subject_token") or ""))
    if subject is None or subject.client_id != client.client_id:
        return _refused("invalid_grant", "the subject token is not an active token of this client")
    asked = str(form.get("scope") or "").split() or list(subject.scopes)
    if any(s not in subject.scopes for s in asked):
        return _refused("invalid_scope", "the scope asked is beyond the subject token's")
    resource = str(form.get("resource") or subject.resource or "") or None
    if subject.resource and resource != subject.resource:
        return _refused("invalid_target", "the resource asked is not the subject token's")
    try:
        wanted = float(form.get("expires_in") or provider.access_lifetime)
    except ValueError:
        return _refused("invalid_request", "expires_in must be a number of seconds")
    lifetime = max(1.0, min(wanted, provider.access_lifetime))
    scopes = asked
    if provider.exchange_mode == "broader":
        scopes = list(dict.fromkeys([*asked, *subject.scopes]))
        if scopes == asked:
            scopes.append(EXTRA_SCOPE)
    elif provider.exchange_mode == "longer":
        lifetime = wanted + 60
    issued = provider.issue(client.client_id, scopes, resource, "token_exchange", lifetime_seconds=lifetime)
    return JSONResponse({**issued.model_dump(exclude_none=True), "issued_token_type": ACCESS_TOKEN_TYPE}, 200,
                        NO_STORE)


def build_app(provider: KitProvider, issuer: str) -> Starlette:
    """The SDK's authorization-server routes, with the token endpoint taking client credentials too."""
    sdk = create_auth_routes(provider, AnyHttpUrl(issuer),  # type: ignore[arg-type]
                             client_registration_options=ClientRegistrationOptions(enabled=False),
                             revocation_options=RevocationOptions(enabled=True))
    authenticator = ClientAuthenticator(provider)  # type: ignore[arg-type]
    sdk_token = TokenHandler(provider, authenticator)  # type: ignore[arg-type]

    async def token(request: Request) -> Response:
        form = await request.form()  # Starlette keeps the parsed form: the SDK's handler reads it again
        if form.get("grant_type") not in ("client_credentials", EXCHANGE_GRANT):
            return await sdk_token.handle(request)
        client = await _basic_client(provider, request, form)
        if client is None:
            try:  # the SDK's authenticator wants client_id in the form (client_secret_post)
                client = await authenticator.authenticate_request(request)
            except AuthenticationError as exc:
                return JSONResponse({"error": "invalid_client", "error_description": exc.message}, 401, NO_STORE)
        if form.get("grant_type") == EXCHANGE_GRANT:
            return await exchange(provider, client, form)
        if "client_credentials" not in (client.grant_types or []):
            return JSONResponse({"error": "unauthorized_client"}, 400, NO_STORE)
        allowed = (client.scope or "").split()
        asked = str(form.get("scope") or "").split() or allowed
        if any(s not in allowed for s in asked):
            return JSONResponse({"error": "invalid_scope"}, 400, NO_STORE)
        resource = form.get("resource")
        issued = provider.issue(client.client_id, asked, str(resource) if resource else None, "client_credentials")
        return JSONResponse(issued.model_dump(exclude_none=True), 200, NO_STORE)

    async def introspect(request: Request) -> Response:
        form = await request.form()
        found = await provider.load_access_token(str(form.get("token") or ""))
        if found is None:
            return JSONResponse({"active": False})
        return JSONResponse({"active": True, "client_id": found.client_id, "scope": " ".join(found.scopes),
                             "exp": found.expires_at, "aud": found.resource, "token_type": "Bearer"})

    async def revoke_client(request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"revoked": provider.revoke_client(str(body["client_id"]))})

    async def stats(request: Request) -> Response:
        return JSONResponse({"issued": dict(provider.issued),
                             "live": Counter(a.client_id for a in provider.access.values())})

    async def tokens(request: Request) -> Response:
        # Every token value this server holds or issued: a test looks for them where they must not be.
        return JSONResponse({"values": sorted({*provider.access, *provider.refresh, *provider.ever})})

    async def lifetime(request: Request) -> Response:
        provider.access_lifetime = float((await request.json())["access"])
        return JSONResponse({"access": provider.access_lifetime})

    async def exchange_mode(request: Request) -> Response:
        body = await request.json()
        mode = str(body.get("mode", provider.exchange_mode))
        if mode not in EXCHANGE_MODES:
            return JSONResponse({"error": f"mode is one of {sorted(EXCHANGE_MODES)}"}, 400)
        provider.exchange_mode = mode
        # Whether the metadata lists the grant (the grant itself keeps working either way).
        listed = [g for g in metadata.grant_types_supported or [] if g != EXCHANGE_GRANT]
        metadata.grant_types_supported = [*listed, EXCHANGE_GRANT] if body.get("advertised", True) else listed
        return JSONResponse({"mode": mode, "advertised": EXCHANGE_GRANT in metadata.grant_types_supported})

    # The SDK's metadata names its own grants; this server also takes client credentials and exchanges.
    metadata = build_metadata(AnyHttpUrl(issuer), None, ClientRegistrationOptions(enabled=False),
                              RevocationOptions(enabled=True))
    metadata.grant_types_supported = [*(metadata.grant_types_supported or []), "client_credentials", EXCHANGE_GRANT]
    routes = [r for r in sdk if r.path not in ("/token", METADATA_PATH)] + [
        Route(METADATA_PATH, MetadataHandler(metadata).handle, methods=["GET"]),
        Route("/token", token, methods=["POST"]), Route("/introspect", introspect, methods=["POST"]),
        Route("/admin/revoke", revoke_client, methods=["POST"]), Route("/admin/stats", stats, methods=["GET"]),
        Route("/admin/lifetime", lifetime, methods=["POST"]), Route("/admin/tokens", tokens, methods=["GET"]),
        Route("/admin/exchange", exchange_mode, methods=["POST"])]
    return Starlette(routes=routes)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve on a loopback port of its own choosing, written to --port-file once it listens."""
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m proofline_kit.oauth", description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=Path, required=True)
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--access-lifetime", type=float, default=300.0)
    parser.add_argument("--refresh-lifetime", type=float, default=None)
    args = parser.parse_args(argv)
    sock = listening_socket("127.0.0.1", 0)
    issuer = f"http://127.0.0.1:{sock.getsockname()[1]}"
    provider = KitProvider(load_clients(args.clients), args.access_lifetime, args.refresh_lifetime)
    app = build_app(provider, issuer)
    tmp = args.port_file.with_name(args.port_file.name + ".tmp")
    tmp.write_text(f"{sock.getsockname()[1]}\n")
    os.replace(tmp, args.port_file)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
