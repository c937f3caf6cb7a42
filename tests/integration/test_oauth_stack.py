"""Remote MCP servers with OAuth 2.1, through real workers: the HTTP system of record requires the
kit authorization server's tokens (proofline_kit/oauth), and the servers file gives the write and
read identities a client of their own (worker/oauth.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger.states import ActionStatus, Outcome
from proofline_kit.oauth.launch import AuthorizationServer
from proofline_kit.oauth.launch import oauth_stack as oauth_stack_of
from tests.conftest import Stack


@pytest.fixture(scope="module")
def oauth_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, AuthorizationServer]]:
    # One pool process: each worker process holds tokens of its own, and the tests below need their
    # next action in the process that holds the token they revoked or let expire (a second process
    # would fetch its first token instead, and prove nothing about replacing one).
    with oauth_stack_of(tmp_path_factory.mktemp("oauth-stack"),
                        {"client_id": "sor-writer", "scope": "sor:write", "refresh_margin_seconds": 1},
                        {"client_id": "sor-reader", "scope": "sor:read", "refresh_margin_seconds": 1},
                        concurrency=1) as both:
        yield both


def ticket(stack: Stack):
    env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": "disk full", "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"})
    stack.publish(env)
    return env, stack.wait_settled(env.action_id)


def recorded(stack: Stack, event: str) -> list[dict]:
    with stack.conn.cursor() as cur:
        cur.execute("SELECT action_id, evidence FROM ledger_events WHERE event = %s ORDER BY id", (event,))
        return list(cur.fetchall())


def test_client_credentials_give_a_verified_action_with_a_token_per_identity(
        oauth_stack: tuple[Stack, AuthorizationServer]) -> None:
    stack, auth = oauth_stack
    env, row = ticket(stack)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert stack.effects(env.idempotency_key) == 1
    issued = auth.stats()["issued"]
    # Two clients at the authorization server: the writer's and the reader's, each by its own grant.
    assert issued.get("sor-writer client_credentials", 0) >= 1 and issued.get("sor-reader client_credentials", 0) >= 1
    refreshed = [r["evidence"] for r in recorded(stack, "oauth_token_refreshed")]
    assert {(e["identity"], e["grant"]) for e in refreshed} >= {("write", "client_credentials"),
                                                                ("read", "client_credentials")}
    assert all(e["scopes"] and e["expires_at"] and e["resource"].endswith("/mcp") for e in refreshed)


def test_a_token_revoked_mid_run_is_replaced_and_the_action_verified(
        oauth_stack: tuple[Stack, AuthorizationServer]) -> None:
    stack, auth = oauth_stack
    ticket(stack)  # the workers hold tokens now
    before = auth.stats()["issued"].get("sor-writer client_credentials", 0)
    assert auth.revoke_client("sor-writer") >= 1
    env, row = ticket(stack)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert stack.effects(env.idempotency_key) == 1
    assert auth.stats()["issued"]["sor-writer client_credentials"] > before
    # The refusal and the new token are evidence on the action whose request met them.
    events = stack.events(env.action_id)
    assert "oauth_token_refreshed" in events


def test_an_expired_token_is_replaced_before_the_next_action(oauth_stack: tuple[Stack, AuthorizationServer]) -> None:
    stack, auth = oauth_stack
    auth.set_lifetime(3)
    try:
        # Every token held now was issued for 300 s: revoked, so that each worker process's next one
        # lives 3 s (a process holding a revoked one meets a 401 first and fetches a short one then).
        auth.revoke_client("sor-writer")
        auth.revoke_client("sor-reader")
        ticket(stack)
        before = auth.stats()["issued"]
        time.sleep(2.5)  # past 3 s less the 1 s margin for whatever the first action fetched
        env, row = ticket(stack)
        assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
        after = auth.stats()["issued"]
        assert after["sor-writer client_credentials"] > before["sor-writer client_credentials"]
        assert after["sor-reader client_credentials"] > before["sor-reader client_credentials"]
        reasons = {e["evidence"]["reason"] for e in stack.timeline(env.action_id)
                   if e["event"] == "oauth_token_refreshed"}
        assert reasons and reasons <= {"expiring", "rejected"}, reasons
    finally:
        auth.set_lifetime(300)


def test_no_secret_reaches_postgres_or_the_logs(oauth_stack: tuple[Stack, AuthorizationServer]) -> None:
    stack, auth = oauth_stack
    ticket(stack)
    secrets = [c["secret"] for c in auth.clients.values() if c.get("secret")] + auth.token_values()
    assert len(secrets) >= 4  # two client secrets and at least a token per identity
    with stack.conn.cursor() as cur:
        cur.execute("SELECT event || ' ' || evidence::text AS e FROM ledger_events")
        stored = "\n".join(r["e"] for r in cur.fetchall())
    logs = "\n".join(p.read_text(errors="replace") for p in Path(stack.workdir).glob("worker-*.log"))
    assert "oauth_token_refreshed" in stored  # positive control: the events are there, their values are not
    for value in secrets:
        assert value not in stored
        assert value not in logs
