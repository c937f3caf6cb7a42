"""Approver users in the console as pure logic: the users file binds each approver to a key file,
the console refuses to start unless that key is an active approver key in the keyring, and each
kind of write names the roles that may send it (only an approver approves)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from proofline.console.access import (
    APPROVER_ONLY,
    OPERATOR_ONLY,
    PROPOSAL_STOPPERS,
    ConsoleRole,
    Session,
    add_user,
    authorize_write,
    load_users,
)
from proofline.console.approvers import approver_keys
from proofline.errors import ConfigurationError, ConsoleForbidden
from proofline.keys import add_approver, generate, revoke
from proofline_kit import zygote


@pytest.fixture
def ring(tmp_path: Path) -> SimpleNamespace:
    generate(tmp_path / "keys", development=True)
    keyring = tmp_path / "keys" / "keyring.json"
    key_id = add_approver(keyring, tmp_path / "alice.key", "alice@example.com", development=True)
    return SimpleNamespace(keyring_file=keyring, environment="development", dir=tmp_path, alice_id=key_id)


def test_an_approver_user_names_its_key_file_and_only_an_approver_does(tmp_path: Path) -> None:
    path = tmp_path / "users.json"
    add_user(path, "apr-alice", ConsoleRole.approver, tmp_path / "alice.key")
    assert load_users(path)["apr-alice"].approver_key == (tmp_path / "alice.key").resolve()
    with pytest.raises(ConfigurationError, match="needs --approver-key"):
        add_user(path, "apr-bob", ConsoleRole.approver)
    with pytest.raises(ConfigurationError, match="needs --approver-key"):
        add_user(path, "ops-carol", ConsoleRole.operator, tmp_path / "alice.key")
    # Written by hand: an approver without a key file, an operator with one.
    for entry in ({"role": "approver"}, {"role": "operator", "approver_key": "/k"}):
        path.write_text(json.dumps({"users": {"x": {**entry, "token_sha256": "0" * 64}}}))
        with pytest.raises(ConfigurationError, match="only an approver, names"):
            load_users(path)


def test_the_console_loads_each_approver_key_with_its_keyring_identity(ring: SimpleNamespace) -> None:
    users_file = ring.dir / "users.json"
    add_user(users_file, "apr-alice", ConsoleRole.approver, ring.dir / "alice.key")
    add_user(users_file, "ops-carol", ConsoleRole.operator)
    found = approver_keys(load_users(users_file), ring)
    assert list(found) == ["apr-alice"]
    assert (found["apr-alice"].key.key_id, found["apr-alice"].identity) == (ring.alice_id, "alice@example.com")


def test_the_console_refuses_to_start_with_a_key_that_is_not_an_active_approver_key(ring: SimpleNamespace) -> None:
    users_file = ring.dir / "users.json"
    # A controller key named as an approver key.
    add_user(users_file, "apr-mallory", ConsoleRole.approver, ring.dir / "keys" / "controller.key")
    with pytest.raises(ConfigurationError, match="console approver 'apr-mallory'.*cannot be used"):
        approver_keys(load_users(users_file), ring)
    # A key file that does not exist.
    add_user(users_file, "apr-mallory", ConsoleRole.approver, ring.dir / "nobody.key")
    with pytest.raises(ConfigurationError, match="apr-mallory"):
        approver_keys(load_users(users_file), ring)
    # An approver key the keyring has revoked.
    add_user(users_file, "apr-mallory", ConsoleRole.approver, ring.dir / "alice.key")
    revoke(ring.keyring_file, ring.alice_id)
    with pytest.raises(ConfigurationError, match=f"key {ring.alice_id} is revoked"):
        approver_keys(load_users(users_file), ring)
    # An approver key from another keyring.
    add_approver(ring.keyring_file, ring.dir / "bob.key", "bob@example.com", development=True)
    other = SimpleNamespace(keyring_file=ring.dir / "keys2" / "keyring.json", environment="development")
    generate(ring.dir / "keys2", development=True)
    add_user(users_file, "apr-mallory", ConsoleRole.approver, ring.dir / "bob.key")
    with pytest.raises(ConfigurationError, match="is not in the keyring"):
        approver_keys(load_users(users_file), other)


def test_each_write_names_who_may_send_it() -> None:
    operator = Session("ops-carol", ConsoleRole.operator, "o" * 43)
    approver = Session("apr-alice", ConsoleRole.approver, "a" * 43)
    viewer = Session("viewer-dan", ConsoleRole.viewer, "v" * 43)
    assert authorize_write(approver, "a" * 43, APPROVER_ONLY) is approver
    with pytest.raises(ConsoleForbidden, match="ops-carol is an operator: only an approver may do this"):
        authorize_write(operator, "o" * 43, APPROVER_ONLY)
    for session in (operator, approver):
        assert authorize_write(session, session.csrf, PROPOSAL_STOPPERS) is session
    with pytest.raises(ConsoleForbidden, match="viewer-dan is a viewer"):
        authorize_write(viewer, "v" * 43, PROPOSAL_STOPPERS)
    # An approver acts on proposals only: the operator's other writes stay the operator's.
    with pytest.raises(ConsoleForbidden, match="apr-alice is an approver: only an operator may do this"):
        authorize_write(approver, "a" * 43, OPERATOR_ONLY)


def _cli(ring: SimpleNamespace, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROOFLINE_KEYRING_FILE": str(ring.keyring_file), "PROOFLINE_STATE_DIR": str(ring.dir),
           "PROOFLINE_ENVIRONMENT": "development"}
    return zygote.run([sys.executable, "-m", "proofline", *args], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_the_commands_refuse_a_key_that_is_not_an_approver_key(ring: SimpleNamespace) -> None:
    users = str(ring.dir / "users.json")
    added = _cli(ring, "console", "add-user", "apr-alice", "--role", "approver", "--approver-key",
                 str(ring.dir / "alice.key"), "--users", users)
    assert added.returncode == 0, added.stderr
    assert load_users(Path(users))["apr-alice"].approver_key == (ring.dir / "alice.key").resolve()
    wrong = _cli(ring, "console", "add-user", "apr-mallory", "--role", "approver", "--approver-key",
                 str(ring.dir / "keys" / "controller.key"), "--users", users)
    assert wrong.returncode != 0 and "configuration_error" in wrong.stderr and "expected 'approver'" in wrong.stderr
    assert "apr-mallory" not in load_users(Path(users))
    # The key revoked after the user was added: the console does not start, and says which user.
    revoke(ring.keyring_file, ring.alice_id)
    started = _cli(ring, "console", "--port", "0", "--users", users)
    assert started.returncode != 0
    assert f"configuration_error: console approver 'apr-alice': key {ring.alice_id} is revoked" in started.stderr
