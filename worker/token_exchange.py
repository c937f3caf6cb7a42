"""A per-action token for the write call: OAuth 2.0 Token Exchange (RFC 8693).

An identity whose ``auth:`` block has ``token_exchange`` (worker/servers.py) does not send its own
token with an action's tools/call. Before the call, the worker presents that token as the
``subject_token`` at the authorization server's token endpoint and asks for an access token with

- ``scope``: the tool's entry of ``tool_scopes``, else ``token_exchange.scope``, else the identity's;
- ``resource``: the MCP server's resource indicator (RFC 8707), as its protected resource metadata
  names it;
- a lifetime: ``lifetime_seconds``, shortened to the action's remaining deadline. RFC 8693 has no
  request parameter for it; the worker sends it as ``expires_in`` (an extension parameter, which an
  authorization server that does not know it ignores, RFC 6749 §3.2) and checks the answer's own
  ``expires_in`` either way.

The answer is checked before anything is sent to the MCP server: a scope the worker did not ask
for is :class:`~proofline.errors.TokenExchangeTooBroad`, a lifetime beyond the one asked (or none
stated) :class:`~proofline.errors.TokenExchangeTooLong`, a refusal or anything but a bearer access
token :class:`~proofline.errors.TokenExchangeFailed`. Each closes the action
``failed_before_side_effect`` under its own code. An accepted token is reported as
``token_exchanged`` (scopes, lifetime, resource, the first 12 hex digits of its SHA-256, never the
value) and carried by that identity's requests while the call runs (worker/mcp_client.py).
Verification reads keep the read identity's own token: they change nothing, and the read identity
is a client of its own with a read scope already.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import math
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx2

from ledger.redact import remember_secret
from proofline.errors import TokenExchangeFailed, TokenExchangeTooBroad, TokenExchangeTooLong
from worker.servers import TokenExchange

if TYPE_CHECKING:
    from worker.oauth import Identity

GRANT = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN = "urn:ietf:params:oauth:token-type:access_token"
EVENT = "token_exchanged"
#: How much of a token's SHA-256 is recorded: enough to match it in a server's log, too little to use.
FINGERPRINT_HEX = 12


@dataclasses.dataclass(frozen=True)
class Asked:
    """What one action's token is asked for."""

    scopes: tuple[str, ...]
    lifetime_seconds: int
    resource: str


@dataclasses.dataclass(frozen=True)
class Exchanged:
    """A per-action token the worker accepted."""

    token: str = dataclasses.field(repr=False)
    scopes: tuple[str, ...]
    expires_in: int
    asked: Asked

    def evidence(self) -> dict[str, Any]:
        return {"scopes": list(self.scopes), "asked_scopes": list(self.asked.scopes), "expires_in": self.expires_in,
                "asked_lifetime_seconds": self.asked.lifetime_seconds, "resource": self.asked.resource,
                "sha256_prefix": fingerprint(self.token)}


def fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:FINGERPRINT_HEX]


def ask(spec: TokenExchange, identity_scope: str | None, tool: str, remaining_seconds: float,
        resource: str) -> Asked:
    """The scope and lifetime an action's token is asked for; TokenExchangeFailed when the deadline
    leaves less than a second (no token can be asked for a shorter life)."""
    scope = spec.tool_scopes.get(tool) or spec.scope or identity_scope or ""
    lifetime = min(spec.lifetime_seconds, math.floor(remaining_seconds))
    if lifetime < 1:
        raise TokenExchangeFailed(f"the action's deadline leaves {remaining_seconds:.1f}s: no token to ask for",
                                  remaining_seconds=round(remaining_seconds, 3))
    return Asked(tuple(scope.split()), lifetime, resource)


def request_form(asked: Asked, subject_token: str) -> dict[str, str]:
    """The token request's form (RFC 8693 §2.1), client authentication aside."""
    return {"grant_type": GRANT, "subject_token": subject_token, "subject_token_type": ACCESS_TOKEN,
            "requested_token_type": ACCESS_TOKEN, "resource": asked.resource, "scope": " ".join(asked.scopes),
            "expires_in": str(asked.lifetime_seconds)}


def check(asked: Asked, status: int, body: Any) -> Exchanged:
    """The token endpoint's answer, accepted only if it is no broader and no longer-lived than asked."""
    if status != 200 or not isinstance(body, dict):
        error = body if isinstance(body, dict) else {}
        raise TokenExchangeFailed(f"the authorization server refused the exchange: HTTP {status} "
                                  f"{str(error.get('error', ''))[:64]} {str(error.get('error_description', ''))[:200]}"
                                  .rstrip(), status=status, error=str(error.get("error", ""))[:64])
    token = body.get("access_token")
    if not isinstance(token, str) or not token:
        raise TokenExchangeFailed("the exchange answered without an access token")
    remember_secret(token)  # from here on, no text the worker writes keeps it
    issued_type = body.get("issued_token_type", ACCESS_TOKEN)
    if issued_type != ACCESS_TOKEN or str(body.get("token_type", "")).lower() != "bearer":
        raise TokenExchangeFailed(f"the exchange issued a {str(issued_type)[:80]} of type "
                                  f"{str(body.get('token_type'))[:20]}, not a bearer access token")
    # RFC 8693 §2.2.1: scope may be left out only when it is the one asked for.
    scopes = tuple(str(body["scope"]).split()) if body.get("scope") is not None else asked.scopes
    wider = sorted(set(scopes) - set(asked.scopes))
    if wider:
        raise TokenExchangeTooBroad(f"the exchanged token carries {' '.join(wider)}, not asked for",
                                    asked=" ".join(asked.scopes), granted=" ".join(scopes))
    expires_in = body.get("expires_in")
    if not isinstance(expires_in, int | float) or isinstance(expires_in, bool):
        raise TokenExchangeTooLong("the exchanged token does not say how long it lives",
                                   asked_lifetime_seconds=asked.lifetime_seconds)
    if expires_in > asked.lifetime_seconds:
        raise TokenExchangeTooLong(f"the exchanged token lives {expires_in}s, more than the "
                                   f"{asked.lifetime_seconds}s asked", asked_lifetime_seconds=asked.lifetime_seconds,
                                   expires_in=expires_in)
    return Exchanged(token, scopes, int(expires_in), asked)


def advertised(metadata: Any) -> bool | None:
    """Whether the authorization server's metadata lists the grant (None: it lists no grants)."""
    grants = getattr(metadata, "grant_types_supported", None)
    return None if grants is None else GRANT in grants


async def exchange(identity: Identity, tool: str, remaining_seconds: float) -> Exchanged | None:
    """The identity's token exchanged for ``tool``'s call (None: ``if_advertised`` and the
    authorization server does not list the grant). Raises a TokenExchangeRefused; nothing was sent."""
    spec = identity.spec.token_exchange
    assert spec is not None
    started = time.monotonic()
    await identity.ensure()  # the subject token: held and valid past the margin
    ctx = identity.provider.context
    listed = advertised(ctx.oauth_metadata)
    if listed is False or (listed is None and spec.use == "if_advertised"):
        if spec.use == "if_advertised":
            return None
        raise TokenExchangeFailed(f"{identity.server}/{identity.role}: the authorization server does not "
                                  f"advertise the token-exchange grant")
    asked = ask(spec, identity.spec.scope, tool, remaining_seconds - (time.monotonic() - started),
                ctx.get_resource_url())
    form = request_form(asked, ctx.current_tokens.access_token)
    headers: dict[str, str] = {}
    secret = identity.client_secret()
    if secret is not None and identity.spec.token_endpoint_auth_method == "client_secret_basic":
        # RFC 6749 §2.3.1: each part form-encoded before the Basic encoding.
        pair = f"{quote(identity.spec.client_id, safe='')}:{quote(secret, safe='')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
    else:
        form["client_id"] = identity.spec.client_id
        if secret is not None:
            form["client_secret"] = secret
    try:
        response = await identity.http().post(str(ctx.oauth_metadata.token_endpoint), data=form, headers=headers)
        body = response.json() if response.content else None
    except (httpx2.HTTPError, ValueError) as exc:
        raise TokenExchangeFailed(f"{identity.server}/{identity.role}: the token exchange did not complete: "
                                  f"{type(exc).__name__}") from None
    got = check(asked, response.status_code, body)
    identity.report(EVENT, got.evidence())
    return got
