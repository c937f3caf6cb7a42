"""Per-action tokens (OAuth 2.0 Token Exchange, RFC 8693) through real workers: the writer identity
holds a token for ``sor:write sor:admin``, and each action's tools/call carries a token exchanged
for ``sor:write`` alone, for the server's resource, living no longer than asked (worker/token_exchange.py).
The HTTP system of record logs every request it admits with the token it carried (SOR_OAUTH_SEEN_LOG),
and the kit's authorization server misbehaves on demand (proofline_kit/oauth)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger.states import Outcome
from proofline_kit.oauth.authorization import EXCHANGE_GRANT
from proofline_kit.oauth.launch import AuthorizationServer, oauth_stack
from tests.conftest import Stack

LIFETIME = 120
CLIENTS: dict[str, dict[str, Any]] = {
    "sor-writer": {"secret": "writer-secret-5d1c0e", "grant_types": ["client_credentials", EXCHANGE_GRANT],
                   "scope": "sor:write sor:admin"},
    "sor-reader": {"secret": "reader-secret-84aa3f", "grant_types": ["client_credentials"], "scope": "sor:read"},
}


@pytest.fixture(scope="module")
def exchange_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, AuthorizationServer, Path]]:
    tmp = tmp_path_factory.mktemp("token-exchange")
    seen = tmp / "seen.jsonl"
    with oauth_stack(tmp, {"client_id": "sor-writer", "scope": "sor:write sor:admin",
                           "token_exchange": {"scope": "sor:write", "lifetime_seconds": LIFETIME}},
                     {"client_id": "sor-reader", "scope": "sor:read"}, clients=CLIENTS,
                     server_env={"SOR_OAUTH_SEEN_LOG": str(seen)}) as (stack, auth):
        yield stack, auth, seen


@pytest.fixture
def normal(exchange_stack: tuple[Stack, AuthorizationServer, Path]) -> Iterator[tuple[Stack, AuthorizationServer, Path]]:
    yield exchange_stack
    exchange_stack[1].set_exchange_mode("normal")


def ticket(stack: Stack, title: str) -> tuple[Any, Any]:
    env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": title, "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"})
    stack.publish(env)
    return env, stack.wait_settled(env.action_id)


def creates(seen: Path) -> list[dict[str, Any]]:
    """The create_ticket calls the writer was sent, each with the token that came with it."""
    lines = [json.loads(line) for line in seen.read_text().splitlines()] if seen.exists() else []
    return [e for e in lines if e["method"] == "tools/call" and e["tool"] == "create_ticket"]


def evidence(stack: Stack, action_id: str, event: str) -> list[dict[str, Any]]:
    return [e["evidence"] for e in stack.timeline(action_id) if e["event"] == event]


def test_the_tools_call_carries_a_token_narrowed_to_the_action(normal: tuple[Stack, AuthorizationServer, Path]) -> None:
    stack, auth, seen = normal
    before = len(creates(seen))
    env, row = ticket(stack, "narrowed")
    assert row.outcome == Outcome.completed_verified
    assert stack.effects(env.idempotency_key) == 1
    [exchanged] = evidence(stack, env.action_id, "token_exchanged")
    assert exchanged["scopes"] == exchanged["asked_scopes"] == ["sor:write"]
    assert exchanged["identity"] == "write" and exchanged["resource"].endswith("/mcp")
    assert 1 <= exchanged["expires_in"] <= exchanged["asked_lifetime_seconds"] <= LIFETIME
    # What the server saw: the create_ticket call came with that very token, for sor:write alone...
    [call] = creates(seen)[before:]
    assert call["sha256_prefix"] == exchanged["sha256_prefix"]
    assert (call["client_id"], call["scopes"], call["resource"]) == ("sor-writer", ["sor:write"],
                                                                     exchanged["resource"])
    # ...while the identity's own requests (tools/list at revalidation) carry its broader token.
    lines = [json.loads(line) for line in seen.read_text().splitlines()]
    own = [e for e in lines if e["client_id"] == "sor-writer" and e["method"] == "tools/list"]
    assert own and all(e["scopes"] == ["sor:write", "sor:admin"] for e in own)
    assert all(e["sha256_prefix"] != exchanged["sha256_prefix"] for e in own)
    assert auth.stats()["issued"].get("sor-writer token_exchange", 0) >= 1
    # The value never reaches the ledger: only its fingerprint.
    with stack.conn.cursor() as cur:
        cur.execute("SELECT string_agg(evidence::text, ' ') AS e FROM ledger_events WHERE action_id = %s",
                    (env.action_id,))
        stored = cur.fetchone()["e"]
    assert not [v for v in auth.token_values() if v in stored]


@pytest.mark.parametrize("mode, reason", [("broader", "token_exchange_too_broad"),
                                          ("longer", "token_exchange_too_long"),
                                          ("refuse", "token_exchange_failed")])
def test_a_token_not_as_asked_or_none_at_all_sends_nothing(
        normal: tuple[Stack, AuthorizationServer, Path], mode: str, reason: str) -> None:
    stack, auth, seen = normal
    ticket(stack, "warm")  # the workers hold the identity's token: only the exchange is left to fail
    auth.set_exchange_mode(mode)
    before = len(creates(seen))
    env, row = ticket(stack, f"refused-{mode}")
    assert row.outcome == Outcome.failed_before_side_effect
    assert stack.effects(env.idempotency_key) == 0
    assert len(creates(seen)) == before  # the server was sent no create_ticket at all
    called = evidence(stack, env.action_id, "tool_called")
    assert called and {c["reason_code"] for c in called} == {reason}
    assert "token_exchanged" not in stack.events(env.action_id)
