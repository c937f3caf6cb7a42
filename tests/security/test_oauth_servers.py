"""OAuth 2.1 for remote MCP servers (worker/oauth.py) against the kit's authorization server and the
system of record requiring its tokens (proofline_kit/oauth): client credentials per identity,
early refresh, expiry and revocation mid-run, and what a refusal is classified as."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import yaml

from proofline.errors import ServerAuthFailed, TokenExchangeFailed
from proofline_kit import zygote
from proofline_kit.oauth.launch import DEFAULT_CLIENTS, AuthorizationServer, start_authorization_server
from proofline_kit.processes import start_process, stop_process, wait_port_file
from proofline_kit.sor import store as sor
from worker.mcp_client import McpSessions
from worker.servers import load_servers
from worker.token_exchange import fingerprint
from worker.tool_call import _sent


@pytest.fixture
def oauth(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """An authorization server, and a system-of-record writer and reader that require its tokens."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "SOR_"))}
    auth = start_authorization_server(tmp_path / "as", env, clients={**DEFAULT_CLIENTS, "sor-writer-post": {
        **DEFAULT_CLIENTS["sor-writer"], "secret": "writer-post-secret-61b0", "auth_method": "client_secret_post"}})
    db = tmp_path / "var" / "sor.sqlite3"
    sor.init_db(db)
    procs = []
    urls = {}
    try:
        for role in ("writer", "reader"):
            port_file = tmp_path / f"sor-{role}.port"
            procs.append(start_process([sys.executable, "-m", "proofline_kit.sor", "--transport", "http", "--port", "0",
                                        "--port-file", str(port_file), "--role", role, "--db", str(db)],
                                       {**env, "SOR_OAUTH_ISSUER": auth.url, "SOR_OAUTH_SEEN_LOG": str(tmp_path / "seen.jsonl")},
                                       tmp_path / f"sor-{role}.log"))
            urls[role] = f"http://127.0.0.1:{wait_port_file(port_file, procs[-1])}/mcp"
        yield {"as": auth, "urls": urls, "tmp": tmp_path}
    finally:
        for proc in procs:
            stop_process(proc, grace=3)
        auth.stop()
        load_servers.cache_clear()


def servers_file(o: dict[str, Any], margin: float = 1.0, **write_auth: Any) -> Any:
    auth: AuthorizationServer = o["as"]
    tmp: Path = o["tmp"]
    spec = {"transport": "http", "url": o["urls"]["writer"],
            "auth": {"type": "oauth", "client_id": "sor-writer", "scope": "sor:write", "issuer": auth.url,
                     "client_secret_file": auth.write_secret("sor-writer", tmp / "writer.secret"),
                     "refresh_margin_seconds": margin, **write_auth},
            "read_identity": {"url": o["urls"]["reader"],
                              "auth": {"type": "oauth", "client_id": "sor-reader", "scope": "sor:read",
                                       "client_secret_file": auth.write_secret("sor-reader", tmp / "reader.secret"),
                                       "refresh_margin_seconds": margin}}}
    path = tmp / f"servers-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump({"servers": {"sor": spec}}))
    load_servers.cache_clear()
    return load_servers(path)["sor"]


def listed(m: McpSessions, server: Any, role: str) -> int:
    async def go(client):  # noqa: ANN001
        return await client.list_tools()

    return len(m.run(server, role, go).tools)


def named(taken: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [f for f in taken if f.get("_event") == name]


def events(m: McpSessions, name: str) -> list[dict[str, Any]]:
    return named(m.take_audit(), name)


def test_each_identity_gets_its_own_token_for_its_own_resource(oauth: dict[str, Any]) -> None:
    server = servers_file(oauth)
    m = McpSessions(oauth["tmp"])
    try:
        with m.acting_for("act-1"):
            assert listed(m, server, "write") > 0
            assert listed(m, server, "read") > 0
            assert listed(m, server, "write") > 0
        got = events(m, "oauth_token_refreshed")
        # One token per identity, each fetched once and then reused, for the URL it was used with.
        assert sorted((e["identity"], e["grant"]) for e in got) == [("read", "client_credentials"),
                                                                   ("write", "client_credentials")]
        assert {e["identity"]: e["resource"] for e in got} == {"write": oauth["urls"]["writer"],
                                                               "read": oauth["urls"]["reader"]}
        assert all(e["action_id"] == "act-1" and e["scopes"] and e["expires_at"] for e in got)
        issued = oauth["as"].stats()["issued"]
        assert issued == {"sor-writer client_credentials": 1, "sor-reader client_credentials": 1}
        text = repr(got)
        for secret in ("writer-secret", "reader-secret", "at-"):
            assert secret not in text
    finally:
        m.close()


def test_a_token_near_expiry_is_fetched_again_before_the_request(oauth: dict[str, Any]) -> None:
    # A 20 s life and a 12 s margin: the first listing has 8 s before its token counts as expiring
    # and 20 s before the server would refuse it (a 3 s life was outlived on a loaded machine: the
    # server answered 401 and the refresh read "rejected"); 8.5 s later it is within the margin.
    oauth["as"].set_lifetime(20)
    server = servers_file(oauth, margin=12.0)
    m = McpSessions(oauth["tmp"])
    try:
        listed(m, server, "write")
        time.sleep(8.5)  # within the margin of its life: fetched again before anything is sent
        listed(m, server, "write")
        reasons = [e["reason"] for e in events(m, "oauth_token_refreshed")]
        assert reasons == ["first", "expiring"]
    finally:
        m.close()


def test_a_revoked_token_is_refetched_once_on_its_401(oauth: dict[str, Any]) -> None:
    server = servers_file(oauth)
    m = McpSessions(oauth["tmp"])
    try:
        listed(m, server, "write")
        assert oauth["as"].revoke_client("sor-writer") == 1
        assert listed(m, server, "write") > 0  # the 401 brought a new token, and the retry passed
        taken = m.take_audit()
        assert [e["reason"] for e in named(taken, "oauth_token_refreshed")] == ["first", "rejected"]
        assert [(e["status"], e["refetched"], e["accepted"]) for e in named(taken, "oauth_token_rejected")] == \
            [(401, True, True)]
        assert oauth["as"].stats()["issued"]["sor-writer client_credentials"] == 2
    finally:
        m.close()


def test_a_client_the_authorization_server_refuses_fails_before_sending(oauth: dict[str, Any]) -> None:
    server = servers_file(oauth)
    (oauth["tmp"] / "writer.secret").write_text("not-the-secret\n")
    m = McpSessions(oauth["tmp"])
    try:
        with pytest.raises(ServerAuthFailed, match="refused the client credentials"):
            listed(m, server, "write")
        assert listed(m, server, "read") > 0  # the other identity is unaffected
    finally:
        m.close()


def test_servers_login_stores_a_refresh_token_the_worker_then_uses(oauth: dict[str, Any]) -> None:
    tmp: Path = oauth["tmp"]
    auth: AuthorizationServer = oauth["as"]
    spec = {"transport": "http", "url": oauth["urls"]["writer"],
            "auth": {"type": "oauth", "grant": "refresh_token", "client_id": "operator-cli", "scope": "sor:write",
                     "refresh_margin_seconds": 1},
            "read_identity": {"url": oauth["urls"]["reader"]}}
    path = tmp / "servers-login.yaml"
    path.write_text(yaml.safe_dump({"servers": {"sor": spec}}))
    state = tmp / "state"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")},
           "PROOFLINE_SERVERS_FILE": str(path), "PROOFLINE_STATE_DIR": str(state)}
    proc = zygote.spawn([sys.executable, "-m", "proofline", "servers", "login", "sor", "--timeout", "60"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for _ in range(20):  # the URL follows one line of text
            line = proc.stderr.readline()  # type: ignore[union-attr]
            if line.startswith("http"):
                url = line.strip()
                break
        assert url is not None and "code_challenge=" in url and "resource=" in url
        # The operator's browser: the test AS approves at once and redirects to the loopback listener.
        answer = httpx.get(url, follow_redirects=True, timeout=10)
        assert answer.status_code == 200 and "received the authorization" in answer.text
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    stored = state / "secrets" / "oauth-sor-write.refresh"
    assert str(stored) in out
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    refresh = stored.read_text().strip()
    assert refresh.startswith("rt-") and refresh not in out + err
    # The worker's sessions refresh from the stored token (a new access token, no person involved).
    load_servers.cache_clear()
    server = load_servers(path)["sor"]
    os.environ["PROOFLINE_STATE_DIR"] = str(state)
    from proofline.settings import get_settings

    get_settings.cache_clear()
    m = McpSessions(tmp)
    try:
        assert listed(m, server, "write") > 0
        got = events(m, "oauth_token_refreshed")
        assert [(e["grant"], e["reason"]) for e in got] == [("refresh_token", "first")]
    finally:
        m.close()
        os.environ.pop("PROOFLINE_STATE_DIR")
        get_settings.cache_clear()
    assert auth.stats()["issued"]["operator-cli refresh_token"] == 1


def test_a_refusal_after_sending_is_the_servers_error_not_a_failure_to_send(oauth: dict[str, Any]) -> None:
    server = servers_file(oauth)
    m = McpSessions(oauth["tmp"])
    try:
        listed(m, server, "write")
        m.take_audit()
        # Revoked at the authorization server, and the secret it would be fetched again with is wrong:
        # the worker still holds a token it believes valid, so the request goes out and meets a 401.
        (oauth["tmp"] / "writer.secret").write_text("rotated-elsewhere\n")
        oauth["as"].revoke_client("sor-writer")
        with pytest.raises(Exception) as raised:  # noqa: PT011 - the SDK's error for a refused request
            listed(m, server, "write")
        assert not isinstance(raised.value, ServerAuthFailed)
        assert _sent(raised.value)  # sent: a write would take the unknown-outcome path
        [rejected] = events(m, "oauth_token_rejected")
        assert rejected["refetch_failed"] == "OAuthTokenError"  # the token endpoint refused the secret
        assert "rotated-elsewhere" not in repr(rejected)
    finally:
        m.close()


def seen(o: dict[str, Any]) -> list[dict[str, Any]]:
    """What the writer and the reader admitted, in order, each with the token it carried."""
    path = o["tmp"] / "seen.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_an_exchanged_token_goes_with_the_calls_inside_and_with_those_only(oauth: dict[str, Any]) -> None:
    server = servers_file(oauth, token_exchange={"scope": "sor:write", "lifetime_seconds": 60})
    m = McpSessions(oauth["tmp"])
    try:
        with m.acting_for("act-x"):
            listed(m, server, "write")
            with m.exchanged_token(server, "write", "create_ticket", 30.9) as got:
                listed(m, server, "write")
            listed(m, server, "write")
        assert got is not None and 25 <= got.asked.lifetime_seconds <= 30 and 1 <= got.expires_in <= 30
        sent = [e["sha256_prefix"] for e in seen(oauth) if e["method"] == "tools/list"]
        own = fingerprint(m._identities[("sor", "write")].provider.context.current_tokens.access_token)
        assert sent[-3:] == [own, fingerprint(got.token), own]
        [event] = events(m, "token_exchanged")
        assert (event["action_id"], event["identity"], event["sha256_prefix"]) == ("act-x", "write",
                                                                                   fingerprint(got.token))
        assert event["resource"] == oauth["urls"]["writer"] and got.token not in repr(event)
        assert oauth["as"].stats()["issued"]["sor-writer token_exchange"] == 1
    finally:
        m.close()


def test_a_refused_exchanged_token_is_not_replaced_after_sending(oauth: dict[str, Any]) -> None:
    server = servers_file(oauth, token_exchange={"scope": "sor:write"})
    m = McpSessions(oauth["tmp"])
    try:
        listed(m, server, "write")
        with m.exchanged_token(server, "write", "create_ticket", 60.0):
            oauth["as"].revoke_client("sor-writer")  # the exchanged token with the rest
            with pytest.raises(Exception) as raised:  # noqa: PT011 - the SDK's error for a refused request
                listed(m, server, "write")
        assert _sent(raised.value)  # a write would take the unknown-outcome path
        taken = m.take_audit()
        assert [(e["status"], e["exchanged"]) for e in named(taken, "oauth_token_rejected")] == [(401, True)]
        assert oauth["as"].stats()["issued"]["sor-writer client_credentials"] == 1  # no token fetched for it
    finally:
        m.close()


def test_an_authorization_server_that_does_not_list_the_grant(oauth: dict[str, Any]) -> None:
    oauth["as"].set_exchange_mode("normal", advertised=False)
    m = McpSessions(oauth["tmp"])
    try:
        # if_advertised: the identity's own token, and no exchange asked for.
        lenient = servers_file(oauth, token_exchange={"use": "if_advertised", "scope": "sor:write"})
        with m.exchanged_token(lenient, "write", "create_ticket", 60.0) as got:
            assert got is None
            listed(m, lenient, "write")
        m.close()
        # always: refused before anything reaches the server.
        before = len(seen(oauth))
        strict = servers_file(oauth, token_exchange={"scope": "sor:write"})
        m = McpSessions(oauth["tmp"])
        with pytest.raises(TokenExchangeFailed, match="does not advertise"), \
                m.exchanged_token(strict, "write", "create_ticket", 60.0):
            pass
        assert len(seen(oauth)) == before
        assert "sor-writer token_exchange" not in oauth["as"].stats()["issued"]
    finally:
        m.close()


def test_a_client_authenticated_in_the_form_exchanges_too(oauth: dict[str, Any]) -> None:
    server = servers_file(oauth, token_endpoint_auth_method="client_secret_post", client_id="sor-writer-post",
                          client_secret_file=oauth["as"].write_secret("sor-writer-post", oauth["tmp"] / "post.secret"),
                          token_exchange={"scope": "sor:write", "tool_scopes": {"close_ticket": "sor:write"}})
    m = McpSessions(oauth["tmp"])
    try:
        with m.exchanged_token(server, "write", "close_ticket", 45.0) as got:
            assert listed(m, server, "write") > 0
        # The identity's own token was fetched first, inside the 45 s: the lifetime asked is what was left.
        assert got is not None and got.scopes == ("sor:write",) and 35 <= got.asked.lifetime_seconds <= 45
        assert oauth["as"].stats()["issued"]["sor-writer-post token_exchange"] == 1
        assert seen(oauth)[-1]["sha256_prefix"] == fingerprint(got.token)
    finally:
        m.close()
