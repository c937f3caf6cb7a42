"""The servers file's ``auth: {type: oauth}`` block (worker/servers.py), what a missing token is
classified as, and the redaction of the credentials a process holds (ledger/redact.py)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from ledger.redact import MARK, POLICY, remember_secret, scrub_text
from ledger.states import Outcome
from proofline.contracts import contract_for
from proofline.errors import ConfigurationError, ServerAuthFailed
from proofline.settings import ROOT
from worker.classify import CallReport, classify
from worker.oauth import refresh_token_path, write_secret_file
from worker.servers import load_servers
from worker.tool_call import _sent

URL = "http://127.0.0.1:1/mcp"


def load(tmp_path: Path, spec: dict[str, Any]) -> Any:
    path = tmp_path / "servers.yaml"
    path.write_text(yaml.safe_dump({"servers": {"api": spec}}))
    load_servers.cache_clear()
    try:
        return load_servers(path)["api"]
    finally:
        load_servers.cache_clear()


def oauth(**kw: Any) -> dict[str, Any]:
    return {"type": "oauth", "client_id": "writer", "client_secret_file": "secrets/writer", **kw}


def test_the_auth_block_is_per_identity_and_its_files_are_anchored(tmp_path: Path) -> None:
    server = load(tmp_path, {"transport": "http", "url": URL, "auth": oauth(scope="a:write"),
                             "read_identity": {}})
    assert server.write.auth is not None and server.write.auth.grant == "client_credentials"
    assert server.write.auth.client_secret_file == str(tmp_path / "secrets" / "writer")
    assert server.read.auth is None  # never inherited: the reader declares its own client or has none
    both = load(tmp_path, {"transport": "http", "url": URL, "auth": oauth(),
                           "read_identity": {"auth": oauth(client_id="reader", client_secret_file="/run/r")}})
    assert (both.write.auth.client_id, both.read.auth.client_id) == ("writer", "reader")


@pytest.mark.parametrize("spec, message", [
    ({"transport": "stdio", "command": ["true"], "auth": oauth()}, "http servers only"),
    ({"transport": "http", "url": URL, "auth": {"type": "oauth", "client_id": "w"}}, "needs a client_secret_file"),
    ({"transport": "http", "url": URL, "auth": oauth(type="basic")}, "type"),
    ({"transport": "http", "url": URL, "auth": oauth(), "headers_from_files": {"Authorization": "/x"}},
     "exclude each other"),
    ({"transport": "http", "url": URL, "auth": oauth(grant="password")}, "grant"),
])
def test_bad_auth_blocks_are_refused_with_the_server_named(tmp_path: Path, spec: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        load(tmp_path, {**spec, "read_identity": {}})


def test_a_public_client_logs_in_without_a_secret_and_stores_its_token_in_the_state_folder(tmp_path: Path) -> None:
    server = load(tmp_path, {"transport": "http", "url": URL,
                             "auth": {"type": "oauth", "grant": "refresh_token", "client_id": "cli"},
                             "read_identity": {}})
    assert refresh_token_path(server.write.auth, "api", "write", tmp_path) == tmp_path / "secrets" / \
        "oauth-api-write.refresh"
    target = tmp_path / "secrets" / "oauth-api-write.refresh"
    write_secret_file(target, "rt-value-123")
    assert target.read_text() == "rt-value-123\n" and target.stat().st_mode & 0o777 == 0o600


def test_no_token_before_sending_is_failed_before_side_effect_with_its_own_reason() -> None:
    error = ServerAuthFailed("the authorization server refused the client credentials")
    assert not _sent(error)
    verdict = classify(CallReport(sent=False, error=error), contract_for(ROOT / "contracts", "ticket.create"))
    assert (verdict.outcome, verdict.reason_code) == (Outcome.failed_before_side_effect, "server_auth_failed")
    # Any other failure to send keeps the general reason.
    other = classify(CallReport(sent=False, error=ConnectionRefusedError(111, "refused")),
                     partial(contract_for, ROOT / "contracts")("ticket.create"))
    assert other.reason_code == "not_sent"


def test_credentials_the_process_holds_are_scrubbed_from_any_text() -> None:
    value = "cs-" + "9f8e7d6c5b4a" * 2
    assert value in scrub_text(f"invalid_client for {value}")  # not known yet: nothing names it a secret
    remember_secret(value)
    assert scrub_text(f"invalid_client for {value}") == f"invalid_client for {MARK}"
    assert POLICY({"detail": f"x {value} y"}) == {"detail": f"x {MARK} y"}
    remember_secret("short")  # too short to hunt for: words would be erased
    assert scrub_text("a short text") == "a short text"
