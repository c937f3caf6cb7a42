"""The resource-server side: an MCP server of the kit that requires the test authorization server's
tokens (``SOR_OAUTH_ISSUER``).

It publishes its protected resource metadata (RFC 9728) at
``/.well-known/oauth-protected-resource/mcp``, names it in the ``WWW-Authenticate`` header of every
401, and admits a request only with a bearer token that the authorization server, asked by
introspection (RFC 7662), says is active, unexpired, carries the required scope and was issued for
this very resource (RFC 8707 audience: the URL the client reached, taken from the request's Host,
since the server sits behind a witness relay on another port). Tokens are verified through the
SDK's ``TokenVerifier`` protocol; the introspection answer is never cached, so a revocation holds
from the next request on.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from typing import Any

import httpx2
from mcp.server.auth.provider import AccessToken
from mcp.shared.auth import ProtectedResourceMetadata

METADATA_PATH = "/.well-known/oauth-protected-resource"
#: Requests admitted, by client id (the ``oauth_seen`` count a test reads through the AS's stats).
ADMITTED: Counter[str] = Counter()


class IntrospectionVerifier:
    """The SDK's ``TokenVerifier``: an access token is what the authorization server says it is."""

    def __init__(self, issuer: str) -> None:
        self.issuer = issuer.rstrip("/")

    async def verify_token(self, token: str) -> AccessToken | None:
        async with httpx2.AsyncClient(timeout=5, trust_env=False) as http:
            answer = (await http.post(f"{self.issuer}/introspect", data={"token": token})).json()
        if not answer.get("active"):
            return None
        return AccessToken(token=token, client_id=answer["client_id"], scopes=str(answer.get("scope", "")).split(),
                           expires_at=answer.get("exp"), resource=answer.get("aud"))


class RequireOAuth:
    """ASGI middleware: the metadata document, and a 401 for any MCP request without a fitting token."""

    def __init__(self, app: Any, issuer: str, scope: str, path: str = "/mcp") -> None:
        self.app, self.scope, self.path = app, scope, path
        self.issuer = issuer.rstrip("/")
        self.verifier = IntrospectionVerifier(issuer)
        #: ``SOR_OAUTH_SEEN_LOG``: one JSON line per admitted request (its JSON-RPC method, the token's
        #: client, scopes, expiry, resource and SHA-256 prefix), for a test to read what it was sent.
        self.seen_log = os.environ.get("SOR_OAUTH_SEEN_LOG") or None

    def _resource(self, scope: dict) -> str:
        host = dict(scope.get("headers") or []).get(b"host", b"127.0.0.1").decode("latin-1")
        return f"http://{host}{self.path}"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        resource = self._resource(scope)
        base = resource[: -len(self.path)]
        if scope["path"] in (METADATA_PATH, METADATA_PATH + self.path):
            # Named exactly as the server's own metadata names itself (a root issuer ends in "/").
            doc = ProtectedResourceMetadata(resource=resource, authorization_servers=[self.issuer + "/"],  # type: ignore[list-item]
                                            scopes_supported=[self.scope], bearer_methods_supported=["header"])
            await _send(send, 200, doc.model_dump_json(exclude_none=True).encode(), b"application/json")
            return
        challenge = f'Bearer resource_metadata="{base}{METADATA_PATH}{self.path}", scope="{self.scope}"'
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        if not header.lower().startswith("bearer "):
            await _send(send, 401, b'{"error": "invalid_token"}', b"application/json", challenge)
            return
        token = await self.verifier.verify_token(header[7:].strip())
        if token is None or token.resource != resource:
            # Revoked, expired, unknown, or issued for another resource: the same answer for each.
            await _send(send, 401, b'{"error": "invalid_token"}', b"application/json",
                        challenge + ', error="invalid_token"')
            return
        if self.scope not in token.scopes:
            await _send(send, 403, json.dumps({"error": "insufficient_scope"}).encode(), b"application/json",
                        challenge + ', error="insufficient_scope"')
            return
        ADMITTED[token.client_id] += 1
        if self.seen_log is not None:
            receive = await self._note(token, receive)
        await self.app(scope, receive, send)

    async def _note(self, token: AccessToken, receive: Any) -> Any:
        """Append what this request carried to the seen log; returns a ``receive`` replaying its body."""
        messages, body = [], b""
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        try:
            request = json.loads(body) if body else {}
            method, params = request.get("method"), request.get("params") or {}
        except (ValueError, AttributeError):
            method, params = None, {}
        line = {"method": method, "tool": params.get("name") if method == "tools/call" else None, "client_id": token.client_id, "scopes": token.scopes, "exp": token.expires_at,
                "resource": token.resource, "sha256_prefix": hashlib.sha256(token.token.encode()).hexdigest()[:12]}
        with open(self.seen_log, "a") as handle:
            handle.write(json.dumps(line) + "\n")

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        return replay


async def _send(send: Any, status: int, body: bytes, content_type: bytes, challenge: str | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if challenge is not None:
        headers.append((b"www-authenticate", challenge.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
