"""Sealing captured evidence (proofline/vault.py) and the auditor's key files (proofline/auditor_keys.py),
without services: what opens, what fails authentication, what a production process refuses."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from ledger.states import CaptureKind
from proofline.auditor_keys import AuditorKey, read_private, read_public, write_pair
from proofline.contracts import EvidenceCapture
from proofline.errors import AuditorKeyRequired, ConfigurationError, EvidenceCaptureTampered
from proofline.vault import open_sealed, seal

KEY = AuditorKey("auditor-test", X25519PrivateKey.generate())
VALUE = {"title": "s3cret-title", "nested": [1, 2.5, None, {"k": "\ud800"}]}


def sealed(**kw):
    return seal(KEY.public, capture_id="cap-1", action_id="act-1", kind=CaptureKind.arguments.value,
                value=kw.get("value", VALUE))


def test_the_auditor_opens_what_was_sealed_and_the_ciphertext_does_not_hold_it() -> None:
    item = sealed()
    assert open_sealed(KEY, item) == json.loads(json.dumps(VALUE))
    assert b"s3cret-title" not in item.ciphertext and item.key_id == KEY.key_id
    # A fresh ephemeral key, nonce and salt every time: the same value never seals the same twice.
    again = sealed()
    assert (again.ephemeral_public, again.nonce, again.ciphertext, again.plaintext_sha256) != (
        item.ephemeral_public, item.nonce, item.ciphertext, item.plaintext_sha256)


@pytest.mark.parametrize("change", [{"action_id": "act-2"}, {"kind": "result"}, {"capture_id": "cap-2"},
                                    {"nonce": os.urandom(12)}, {"plaintext_sha256": "sha256:" + "0" * 64}])
def test_a_blob_moved_or_changed_fails_authentication(change: dict) -> None:
    with pytest.raises(EvidenceCaptureTampered):
        open_sealed(KEY, dataclasses.replace(sealed(), **change))


def test_flipped_ciphertext_and_a_foreign_ephemeral_key_fail() -> None:
    item = sealed()
    flipped = bytes([item.ciphertext[0] ^ 1]) + item.ciphertext[1:]
    with pytest.raises(EvidenceCaptureTampered):
        open_sealed(KEY, dataclasses.replace(item, ciphertext=flipped))
    other = X25519PrivateKey.generate().public_key().public_bytes_raw()
    with pytest.raises(EvidenceCaptureTampered):
        open_sealed(KEY, dataclasses.replace(item, ephemeral_public=other))


def test_another_key_opens_nothing() -> None:
    item = sealed()
    with pytest.raises(AuditorKeyRequired):
        open_sealed(AuditorKey("someone-else", X25519PrivateKey.generate()), item)
    with pytest.raises(EvidenceCaptureTampered):  # the same id on another key: the cryptography says no
        open_sealed(AuditorKey(KEY.key_id, X25519PrivateKey.generate()), item)


def test_key_files_modes_refusals_and_development_keys(tmp_path: Path) -> None:
    key_id = write_pair(tmp_path / "a" / "auditor.key", tmp_path / "auditor.pub", development=True)
    assert stat.S_IMODE((tmp_path / "a" / "auditor.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "auditor.pub").stat().st_mode) == 0o644
    private, public = read_private(tmp_path / "a" / "auditor.key"), read_public(tmp_path / "auditor.pub")
    assert private.key_id == public.key_id == key_id and private.public.raw() == public.raw()
    item = seal(public, capture_id="c", action_id="a", kind="result", value=[1])
    assert open_sealed(private, item) == [1]
    with pytest.raises(ConfigurationError, match="never overwritten"):
        write_pair(tmp_path / "a" / "auditor.key", tmp_path / "auditor.pub")
    with pytest.raises(ConfigurationError, match="development"):
        read_public(tmp_path / "auditor.pub", "production")
    os.chmod(tmp_path / "a" / "auditor.key", 0o640)
    with pytest.raises(ConfigurationError, match="0600"):
        read_private(tmp_path / "a" / "auditor.key")


def test_the_capture_policy_is_off_by_default_and_its_retention_class_is_checked() -> None:
    assert not EvidenceCapture().enabled and EvidenceCapture(reads=True).enabled
    assert EvidenceCapture(result=True).retention == "audit"  # the ledger's retention classes
    assert EvidenceCapture(result=True, retention="legal_hold").retention == "legal_hold"
    with pytest.raises(ValueError):
        EvidenceCapture(arguments=True, retention="Forever!")
