"""Ledger checkpoints without a database: the Merkle root, the signed statement and what opening
a stored checkpoint refuses, and the append-only directory store."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.anchor_keys import PublicKey, SigningKey
from ledger.anchor_store import DirectoryStore
from ledger.checkpoint import FORMAT, leaf_hash, merkle_root, open_checkpoint, sign
from proofline.canonical import canonical_bytes
from proofline.errors import CheckpointExists, CheckpointInvalid
from proofline.keys import KeyRole

LEAVES = [("act-a", 3, "a" * 64), ("act-b", 1, "b" * 64), ("refused:x", 1, "c" * 64)]


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def test_merkle_root_of_three_leaves_has_the_rfc6962_shape():
    a, b, c = (leaf_hash(*leaf) for leaf in LEAVES)
    assert merkle_root(LEAVES) == _node(_node(a, b), c).hex()
    assert merkle_root(LEAVES[:1]) == a.hex()
    assert merkle_root([]) == hashlib.sha256(b"").hexdigest()


def test_leaves_and_nodes_are_domain_separated():
    a, b = leaf_hash(*LEAVES[0]), leaf_hash(*LEAVES[1])
    # A leaf can never be mistaken for an interior node with the same bytes under it.
    assert leaf_hash(*LEAVES[0]) != hashlib.sha256(canonical_bytes(list(LEAVES[0]))).digest()
    assert _node(a, b) != hashlib.sha256(b"\x00" + a + b).digest()


@pytest.mark.parametrize("change", [
    lambda ls: [("act-a", 4, ls[0][2]), *ls[1:]],          # a seq
    lambda ls: [("act-a", 3, "d" * 64), *ls[1:]],          # a head
    lambda ls: ls[:2],                                      # a chain dropped
    lambda ls: [ls[1], ls[0], ls[2]],                       # order
])
def test_any_leaf_change_moves_the_root(change):
    assert merkle_root(change(LEAVES)) != merkle_root(LEAVES)


def _key(key_id: str = "ledger-1") -> tuple[SigningKey, dict[str, PublicKey]]:
    private = Ed25519PrivateKey.generate()
    return SigningKey(key_id, KeyRole.ledger, private), {key_id: PublicKey(key_id, KeyRole.ledger, private.public_key())}


def _checkpoint(key: SigningKey, number: int = 1):
    hashes = {"act-a": {"from": 1, "hashes": ["1" * 64, "2" * 64, "a" * 64]},
              "act-b": {"from": 1, "hashes": ["b" * 64]}, "refused:x": {"from": 1, "hashes": ["c" * 64]}}
    statement = {"format": FORMAT, "ledger": "db", "number": number, "created_at": "2026-01-01T00:00:00+00:00",
                 "key_id": key.key_id, "chains": 3, "events": 5, "merkle_root": merkle_root(LEAVES),
                 "hashes_digest": hashlib.sha256(canonical_bytes(hashes)).hexdigest(), "prev": None,
                 "diverged": []}
    return sign(statement, list(LEAVES), hashes, key)


def test_a_signed_checkpoint_opens_and_round_trips():
    key, keys = _key()
    cp = _checkpoint(key)
    opened = open_checkpoint(1, cp.to_bytes(), keys)
    assert (opened.hash, opened.leaves, opened.heads()["act-a"]) == (cp.hash, LEAVES, (3, "a" * 64))


def _edit(data: bytes, edit) -> bytes:
    body = json.loads(data)
    edit(body)
    return json.dumps(body).encode()


@pytest.mark.parametrize(("edit", "says"), [
    (lambda b: b["statement"].update(events=6), "signature does not verify"),
    (lambda b: b["leaves"][0].__setitem__(2, "e" * 64), "Merkle root"),
    (lambda b: b["hashes"]["act-a"]["hashes"].__setitem__(0, "9" * 64), "digest"),
    (lambda b: b.update(signature="not base64!"), "malformed"),
    (lambda b: b.pop("leaves"), "malformed"),
])
def test_an_edited_checkpoint_is_refused(edit, says):
    key, keys = _key()
    data = _edit(_checkpoint(key).to_bytes(), edit)
    with pytest.raises(CheckpointInvalid, match=says) as info:
        open_checkpoint(1, data, keys)
    assert info.value.code == "checkpoint_invalid"


def test_a_checkpoint_signed_by_another_key_is_refused():
    key, _ = _key("ledger-1")
    _, other = _key("ledger-1")  # same key id, different key
    with pytest.raises(CheckpointInvalid, match="signature does not verify"):
        open_checkpoint(1, _checkpoint(key).to_bytes(), other)
    with pytest.raises(CheckpointInvalid, match="not a ledger key"):
        open_checkpoint(1, _checkpoint(key).to_bytes(), {})


def test_a_revoked_key_and_a_wrong_number_are_refused():
    key, keys = _key()
    revoked = {key.key_id: PublicKey(key.key_id, KeyRole.ledger, key.public, revoked=True)}
    with pytest.raises(CheckpointInvalid, match="revoked"):
        open_checkpoint(1, _checkpoint(key).to_bytes(), revoked)
    with pytest.raises(CheckpointInvalid, match="not checkpoint 2"):
        open_checkpoint(2, _checkpoint(key).to_bytes(), keys)


def test_directory_store_appends_and_never_overwrites(tmp_path):
    store = DirectoryStore(tmp_path / "ledger")
    assert store.list() == [] and store.latest() is None
    store.append(1, b"one")
    store.append(2, b"two")
    with pytest.raises(CheckpointExists):
        store.append(2, b"other")
    assert store.read(2) == b"two"
    assert store.list() == [1, 2] and store.latest() == (2, b"two")
    # No temporary file is left behind, and stored files are read-only.
    assert sorted(os.listdir(tmp_path / "ledger")) == ["000000000001.json", "000000000002.json"]
    assert not os.stat(tmp_path / "ledger" / "000000000002.json").st_mode & 0o222
    with pytest.raises(CheckpointInvalid, match="cannot be read"):
        store.read(3)
