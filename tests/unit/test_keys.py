"""Key files: what `proofline keys generate` writes, what loading accepts and refuses, rotation,
revocation, and the production rule against development keys."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from proofline.errors import ConfigurationError
from proofline.keys import (
    KeyRole,
    check_process_keys,
    generate,
    load_keyring,
    load_signing_key,
    read_signing_key,
    revoke,
    rotate,
)
from proofline.settings import ROOT, Settings
from proofline_kit import zygote

FILES = ("controller.key", "recovery.key", "ledger.key", "worker.key", "seal.key", "keyring.json", "auditor.key",
         "auditor.pub")
SIGNING_ROLES = ("controller", "recovery", "ledger", "worker")


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")}
    return zygote.run([sys.executable, "-m", "proofline", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=60)


def test_generate_writes_the_eight_files_in_the_agreed_format(tmp_path: Path) -> None:
    result = cli("keys", "generate", "--dir", str(tmp_path / "k"))
    assert result.returncode == 0, result.stderr
    d = tmp_path / "k"
    assert sorted(p.name for p in d.iterdir()) == sorted(FILES)
    assert stat.S_IMODE((d / "auditor.pub").stat().st_mode) == 0o644
    for name in ("controller.key", "recovery.key", "ledger.key", "worker.key", "seal.key", "auditor.key"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600, name
    ring = json.loads((d / "keyring.json").read_text())
    by_role = {e["role"]: e for e in ring["keys"]}
    assert sorted(by_role) == sorted(SIGNING_ROLES)
    for role in SIGNING_ROLES:
        key = json.loads((d / f"{role}.key").read_text())
        assert set(key) == {"key_id", "role", "private_key"} and key["role"] == role
        assert len(base64.b64decode(key["private_key"])) == 32
        entry = by_role[role]
        assert set(entry) == {"key_id", "role", "public_key", "not_after", "revoked"}
        assert (entry["key_id"], entry["not_after"], entry["revoked"]) == (key["key_id"], None, False)
        # The keyring's public key is the private key's: a signature made with one verifies with the other.
        signer = read_signing_key(d / f"{role}.key", KeyRole(role))
        Ed25519PublicKey.from_public_bytes(base64.b64decode(entry["public_key"])).verify(signer.sign(b"x"), b"x")
    seal = json.loads((d / "seal.key").read_text())
    assert set(seal) == {"key_id", "key"} and len(base64.b64decode(seal["key"])) == 32
    assert len({json.loads((d / f).read_text())["key_id"] for f in FILES if f != "keyring.json"}) == 6
    # The auditor's pair is X25519, not a signing key: no keyring entry, its public half in its own file.
    auditor, public = (json.loads((d / f).read_text()) for f in ("auditor.key", "auditor.pub"))
    assert set(auditor) == {"key_id", "role", "private_key"} and set(public) == {"key_id", "role", "public_key"}
    assert auditor["key_id"] == public["key_id"] and auditor["role"] == public["role"] == "auditor"


def test_generate_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    generate(tmp_path)
    before = (tmp_path / "controller.key").read_text()
    refused = cli("keys", "generate", "--dir", str(tmp_path))
    assert refused.returncode != 0 and "--force" in refused.stderr
    assert (tmp_path / "controller.key").read_text() == before
    assert cli("keys", "generate", "--dir", str(tmp_path), "--force").returncode == 0
    assert (tmp_path / "controller.key").read_text() != before


def test_development_keys_are_marked_and_refused_in_production(tmp_path: Path) -> None:
    generate(tmp_path, development=True)
    assert json.loads((tmp_path / "controller.key").read_text())["development"] is True
    assert all(e["development"] for e in json.loads((tmp_path / "keyring.json").read_text())["keys"])
    load_signing_key(tmp_path / "controller.key", KeyRole.controller)  # fine in development
    with pytest.raises(ConfigurationError, match="development key"):
        read_signing_key(tmp_path / "controller.key", KeyRole.controller, "production")
    with pytest.raises(ConfigurationError, match="development key"):
        load_keyring(tmp_path / "keyring.json", "production")


def test_production_worker_refuses_to_start_with_development_keys(tmp_path: Path) -> None:
    generate(tmp_path, development=True)
    result = cli("worker", "--role", "recovery", env={"PROOFLINE_KEYS_DIR": str(tmp_path),
                                                      "PROOFLINE_ENVIRONMENT": "production"})
    assert result.returncode != 0
    assert "development key" in result.stderr


def test_process_roles(tmp_path: Path) -> None:
    generate(tmp_path)
    prod = Settings(keys_dir=tmp_path, environment="production")
    assert check_process_keys(prod, "recovery") == []
    assert check_process_keys(prod, "controller") == []
    # An execute worker that can read a private key refuses to start in production.
    with pytest.raises(ConfigurationError, match="must not be able to read"):
        check_process_keys(prod, "execute")
    with pytest.raises(ConfigurationError, match="separate processes"):
        check_process_keys(prod, "all")
    public_only = tmp_path / "public"
    public_only.mkdir()
    (public_only / "keyring.json").write_text((tmp_path / "keyring.json").read_text())
    # Its own worker key is the one private key an execute worker holds (it signs evidence only).
    with pytest.raises(ConfigurationError, match="worker.key does not exist"):
        check_process_keys(Settings(keys_dir=public_only, environment="production"), "execute")
    (public_only / "worker.key").write_text((tmp_path / "worker.key").read_text())
    (public_only / "worker.key").chmod(0o600)
    assert check_process_keys(Settings(keys_dir=public_only, environment="production"), "execute") == []
    # ... and never the ledger key, even where the other two are out of reach.
    (public_only / "ledger.key").write_text((tmp_path / "ledger.key").read_text())
    (public_only / "ledger.key").chmod(0o600)
    with pytest.raises(ConfigurationError, match="ledger.key"):
        check_process_keys(Settings(keys_dir=public_only, environment="production"), "execute")
    with pytest.raises(ConfigurationError, match="does not exist"):
        check_process_keys(Settings(keys_dir=public_only, environment="production"), "recovery")
    with pytest.raises(ConfigurationError, match="no keyring"):
        check_process_keys(Settings(), "execute")


def test_an_execute_worker_that_can_read_the_auditor_key_is_refused_in_production(tmp_path: Path) -> None:
    generate(tmp_path)
    worker_only = tmp_path / "worker"
    worker_only.mkdir()
    for name in ("keyring.json", "auditor.pub", "worker.key"):
        (worker_only / name).write_text((tmp_path / name).read_text())
    (worker_only / "worker.key").chmod(0o600)
    prod = Settings(keys_dir=worker_only, environment="production")
    assert check_process_keys(prod, "execute") == []  # the public half is what a worker holds
    # The private half, in its keys folder or named by the setting: it could open every capture.
    for held in (worker_only / "auditor.key", tmp_path / "auditor.key"):
        if held.parent == worker_only:
            held.write_text((tmp_path / "auditor.key").read_text())
            held.chmod(0o600)
            settings = prod
        else:
            (worker_only / "auditor.key").unlink()
            settings = Settings(keys_dir=worker_only, environment="production", auditor_key_file=held)
        with pytest.raises(ConfigurationError, match="auditor.key"):
            check_process_keys(settings, "execute")


def test_a_recovery_key_must_be_active_in_the_keyring(tmp_path: Path) -> None:
    generate(tmp_path)
    key_id = json.loads((tmp_path / "recovery.key").read_text())["key_id"]
    revoke(tmp_path / "keyring.json", key_id)
    with pytest.raises(ConfigurationError, match="not an active recovery key"):
        check_process_keys(Settings(keys_dir=tmp_path), "recovery")


def test_a_worker_key_must_be_active_in_the_keyring(tmp_path: Path) -> None:
    generate(tmp_path)
    check_process_keys(Settings(keys_dir=tmp_path), "execute")
    revoke(tmp_path / "keyring.json", json.loads((tmp_path / "worker.key").read_text())["key_id"])
    with pytest.raises(ConfigurationError, match="not an active worker key"):
        check_process_keys(Settings(keys_dir=tmp_path), "execute")


def test_add_worker_writes_one_more_worker_key_and_its_keyring_entry(tmp_path: Path) -> None:
    generate(tmp_path, development=True)
    add = ("keys", "add-worker", "--out", str(tmp_path / "host-b" / "worker.key"), "--keyring",
           str(tmp_path / "keyring.json"), "--development")
    result = cli(*add)
    assert result.returncode == 0, result.stderr
    added = json.loads((tmp_path / "host-b" / "worker.key").read_text())
    assert stat.S_IMODE((tmp_path / "host-b" / "worker.key").stat().st_mode) == 0o600
    assert added["role"] == "worker" and added["development"] is True
    ring = load_keyring(tmp_path / "keyring.json")
    assert [k.role for k in ring.keys.values()].count(KeyRole.worker) == 2
    entry = ring.get(added["key_id"])
    assert entry is not None and not entry.revoked
    signer = read_signing_key(tmp_path / "host-b" / "worker.key", KeyRole.worker)
    entry.public.verify(signer.sign(b"x"), b"x")
    # The second worker starts with its own key file; the first one's is untouched.
    assert check_process_keys(Settings(keys_dir=tmp_path, worker_key_file=tmp_path / "host-b" / "worker.key"),
                              "execute")
    again = cli(*add)
    assert again.returncode != 0 and "already exists" in again.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda k: k.update(role="recovery"), "expected 'controller'"),
        (lambda k: k.update(private_key="not base64!"), "not valid base64"),
        (lambda k: k.update(private_key=base64.b64encode(b"short").decode()), "32 bytes"),
        (lambda k: k.update(key_id=""), "key_id"),
        (lambda k: k.pop("private_key"), "base64 string"),
    ],
    ids=["role", "base64", "length", "key-id", "missing"],
)
def test_malformed_private_key_files_are_refused(tmp_path: Path, change, message: str) -> None:
    generate(tmp_path)
    path = tmp_path / "controller.key"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigurationError, match=message):
        read_signing_key(path, KeyRole.controller)


def test_private_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    generate(tmp_path)
    os.chmod(tmp_path / "controller.key", 0o644)
    with pytest.raises(ConfigurationError, match="0600"):
        read_signing_key(tmp_path / "controller.key", KeyRole.controller)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r["keys"].append(dict(r["keys"][0])), "appears twice"),
        (lambda r: r["keys"][0].update(role="admin"), "unknown role"),
        (lambda r: r["keys"][0].update(not_after="2030-01-01T00:00:00"), "time zone"),
        (lambda r: r["keys"][0].update(not_after="tomorrow"), "ISO-8601"),
        (lambda r: r["keys"][0].update(revoked="no"), "true or false"),
        (lambda r: r["keys"][0].update(public_key=base64.b64encode(b"x" * 31).decode()), "32 bytes"),
        (lambda r: r.pop("keys"), "a keyring is"),
    ],
    ids=["duplicate", "role", "naive-time", "bad-time", "revoked-type", "length", "shape"],
)
def test_malformed_keyrings_are_refused(tmp_path: Path, change, message: str) -> None:
    generate(tmp_path)
    path = tmp_path / "keyring.json"
    ring = json.loads(path.read_text())
    change(ring)
    path.write_text(json.dumps(ring))
    with pytest.raises(ConfigurationError, match=message):
        load_keyring(path)


def test_rotate_keeps_the_old_key_until_not_after_and_the_keyring_reloads(tmp_path: Path) -> None:
    generate(tmp_path)
    ring_path = tmp_path / "keyring.json"
    before = load_keyring(ring_path)
    old_id, new_id = rotate(tmp_path, KeyRole.controller, timedelta(minutes=30))
    after = load_keyring(ring_path)  # reloaded: the file changed on disk
    assert after is not before
    assert set(after.keys) == {*before.keys, new_id}
    assert load_signing_key(tmp_path / "controller.key", KeyRole.controller).key_id == new_id
    old = after.get(old_id)
    assert old is not None and not old.revoked
    assert datetime.now(UTC) + timedelta(minutes=29) < old.not_after < datetime.now(UTC) + timedelta(minutes=31)
    assert after.get(new_id).not_after is None
    assert stat.S_IMODE((tmp_path / "controller.key").stat().st_mode) == 0o600


def test_revoke_marks_the_entry(tmp_path: Path) -> None:
    generate(tmp_path)
    key_id = json.loads((tmp_path / "controller.key").read_text())["key_id"]
    result = cli("keys", "revoke", key_id, "--keyring", str(tmp_path / "keyring.json"))
    assert result.returncode == 0, result.stderr
    assert load_keyring(tmp_path / "keyring.json").get(key_id).revoked
    assert cli("keys", "revoke", "nope", "--keyring", str(tmp_path / "keyring.json")).returncode != 0


def test_key_files_default_to_the_keys_dir(tmp_path: Path) -> None:
    s = Settings(keys_dir=tmp_path)
    assert (s.signing_key_file, s.recovery_key_file, s.keyring_file) == (
        tmp_path / "controller.key", tmp_path / "recovery.key", tmp_path / "keyring.json")
    assert Settings(keys_dir=tmp_path, keyring_file=tmp_path / "other.json").keyring_file == tmp_path / "other.json"
    assert Settings().keyring_file is None


def test_rotating_the_worker_key_keeps_the_old_one_verifiable_until_not_after(tmp_path: Path) -> None:
    generate(tmp_path)
    old, new = rotate(tmp_path, KeyRole.worker, timedelta(hours=1))
    assert json.loads((tmp_path / "worker.key").read_text())["key_id"] == new != old
    ring = load_keyring(tmp_path / "keyring.json")
    retiring, current = ring.get(old), ring.get(new)
    assert retiring is not None and retiring.role == KeyRole.worker and retiring.not_after is not None
    assert current is not None and current.role == KeyRole.worker and current.not_after is None
    check_process_keys(Settings(keys_dir=tmp_path), "execute")
