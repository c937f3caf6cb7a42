"""The per-action token request and the checks on its answer (worker/token_exchange.py), the
servers file's ``token_exchange`` block (worker/servers.py), and what a refusal is classified as."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import yaml

from ledger.redact import MARK, scrub_text
from ledger.states import Outcome
from proofline.contracts import contract_for
from proofline.errors import (
    ConfigurationError,
    TokenExchangeFailed,
    TokenExchangeTooBroad,
    TokenExchangeTooLong,
)
from proofline.settings import ROOT
from worker.classify import CallReport, classify
from worker.servers import TokenExchange, load_servers
from worker.token_exchange import ACCESS_TOKEN, GRANT, Asked, ask, check, fingerprint, request_form
from worker.tool_call import _sent

URL = "http://127.0.0.1:1/mcp"
ASKED = Asked(("sor:write",), 120, URL)


def answer(**kw: Any) -> dict[str, Any]:
    return {"access_token": "at-exchanged-0123456789abcdef", "token_type": "Bearer", "expires_in": 120,
            "scope": "sor:write", "issued_token_type": ACCESS_TOKEN, **kw}


def load(tmp_path: Path, auth: dict[str, Any]) -> Any:
    path = tmp_path / "servers.yaml"
    path.write_text(yaml.safe_dump({"servers": {"api": {"transport": "http", "url": URL, "read_identity": {},
                                                        "auth": {"type": "oauth", "client_id": "w",
                                                                 "client_secret_file": "w.secret", **auth}}}}))
    load_servers.cache_clear()
    try:
        return load_servers(path)["api"]
    finally:
        load_servers.cache_clear()


def test_the_asked_scope_is_the_tools_then_the_blocks_then_the_identitys() -> None:
    spec = TokenExchange(scope="sor:write", tool_scopes={"delete_ticket": "sor:write sor:delete"}, lifetime_seconds=300)
    assert ask(spec, "sor:write sor:delete", "create_ticket", 900.0, URL).scopes == ("sor:write",)
    assert ask(spec, "sor:write sor:delete", "delete_ticket", 900.0, URL).scopes == ("sor:write", "sor:delete")
    assert ask(TokenExchange(), "sor:read sor:write", "x", 900.0, URL).scopes == ("sor:read", "sor:write")


def test_the_lifetime_is_never_past_the_actions_deadline() -> None:
    spec = TokenExchange(scope="a", lifetime_seconds=300)
    assert ask(spec, None, "t", 900.0, URL).lifetime_seconds == 300
    assert ask(spec, None, "t", 41.9, URL).lifetime_seconds == 41  # rounded down, never up
    with pytest.raises(TokenExchangeFailed, match="deadline"):
        ask(spec, None, "t", 0.6, URL)


def test_the_request_is_an_rfc_8693_exchange_for_the_servers_resource() -> None:
    form = request_form(Asked(("a", "b"), 60, URL), "at-subject")
    assert form == {"grant_type": GRANT, "subject_token": "at-subject", "subject_token_type": ACCESS_TOKEN,
                    "requested_token_type": ACCESS_TOKEN, "resource": URL, "scope": "a b", "expires_in": "60"}


def test_an_answer_as_asked_or_narrower_is_accepted_and_its_value_kept_out_of_the_evidence() -> None:
    got = check(ASKED, 200, answer())
    assert (got.scopes, got.expires_in) == (("sor:write",), 120)
    evidence = got.evidence()
    assert evidence["sha256_prefix"] == fingerprint("at-exchanged-0123456789abcdef") and len(evidence["sha256_prefix"]) == 12
    assert "at-exchanged-0123456789abcdef" not in repr(evidence) + repr(got)
    # Received, so known to the redaction policy from then on.
    assert scrub_text("x at-exchanged-0123456789abcdef y") == f"x {MARK} y"
    # No scope in the answer is the scope asked (RFC 8693 §2.2.1); a shorter life is fine.
    assert check(ASKED, 200, answer(scope=None, expires_in=30)).scopes == ("sor:write",)


@pytest.mark.parametrize("changed, error, code", [
    ({"scope": "sor:write sor:admin"}, TokenExchangeTooBroad, "token_exchange_too_broad"),
    ({"expires_in": 121}, TokenExchangeTooLong, "token_exchange_too_long"),
    ({"expires_in": None}, TokenExchangeTooLong, "token_exchange_too_long"),
    ({"issued_token_type": "urn:ietf:params:oauth:token-type:refresh_token"}, TokenExchangeFailed,
     "token_exchange_failed"),
    ({"token_type": "N_A"}, TokenExchangeFailed, "token_exchange_failed"),
    ({"access_token": ""}, TokenExchangeFailed, "token_exchange_failed"),
])
def test_an_answer_broader_longer_or_not_a_bearer_token_is_refused(changed: dict, error: type, code: str) -> None:
    body = {k: v for k, v in answer(**changed).items() if v is not None}
    with pytest.raises(error) as raised:
        check(ASKED, 200, body)
    assert raised.value.code == code


def test_a_refusal_names_the_oauth_error() -> None:
    with pytest.raises(TokenExchangeFailed, match="HTTP 400 invalid_grant") as raised:
        check(ASKED, 400, {"error": "invalid_grant", "error_description": "no"})
    assert raised.value.context["error"] == "invalid_grant"
    with pytest.raises(TokenExchangeFailed, match="HTTP 502"):
        check(ASKED, 502, None)


@pytest.mark.parametrize("error", [TokenExchangeFailed("refused"), TokenExchangeTooBroad("wide", granted="a b"),
                                   TokenExchangeTooLong("long")])
def test_a_refused_exchange_is_failed_before_side_effect_under_its_own_code(error: Exception) -> None:
    assert not _sent(error)
    assert pickle.loads(pickle.dumps(error)).code == error.code  # type: ignore[attr-defined]
    verdict = classify(CallReport(sent=False, error=error), contract_for(ROOT / "contracts", "ticket.create"))
    assert (verdict.outcome, verdict.reason_code) == (Outcome.failed_before_side_effect, error.code)  # type: ignore[attr-defined]


def test_the_block_loads_and_may_only_narrow_the_identitys_scope(tmp_path: Path) -> None:
    server = load(tmp_path, {"scope": "sor:write sor:admin",
                             "token_exchange": {"scope": "sor:write", "lifetime_seconds": 60,
                                                "tool_scopes": {"purge": "sor:admin"}}})
    spec = server.write.auth.token_exchange
    assert (spec.use, spec.scope, spec.lifetime_seconds, spec.tool_scopes) == ("always", "sor:write", 60,
                                                                               {"purge": "sor:admin"})
    assert load(tmp_path, {"scope": "a"}).write.auth.token_exchange is None
    for bad, message in [({"scope": "sor:write", "token_exchange": {"scope": "sor:write sor:admin"}}, "beyond"),
                         ({"scope": "a", "token_exchange": {"tool_scopes": {"t": "b"}}}, "tool_scopes.t asks for b"),
                         ({"token_exchange": {}}, "names no scope"),
                         ({"scope": "a", "token_exchange": {"lifetime_seconds": 0}}, "lifetime_seconds"),
                         ({"scope": "a", "token_exchange": {"use": "sometimes"}}, "use")]:
        with pytest.raises(ConfigurationError, match=message):
            load(tmp_path, bad)


def test_a_read_identity_cannot_ask_for_per_action_tokens(tmp_path: Path) -> None:
    path = tmp_path / "servers.yaml"
    reader = {"type": "oauth", "client_id": "r", "client_secret_file": "r.secret", "scope": "sor:read",
              "token_exchange": {"scope": "sor:read"}}
    path.write_text(yaml.safe_dump({"servers": {"api": {"transport": "http", "url": URL,
                                                        "read_identity": {"auth": reader}}}}))
    load_servers.cache_clear()
    try:
        with pytest.raises(ConfigurationError, match="for the write call only"):
            load_servers(path)
    finally:
        load_servers.cache_clear()
