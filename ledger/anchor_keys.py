"""The ledger's Ed25519 keys, read from the agreed key files (nothing else; the key material never
comes from the environment).

- ``ledger.key``: ``{"key_id", "role": "ledger", "private_key": base64(raw 32-byte seed)}``, mode 0600,
  held only by the processes that write checkpoints.
- ``keyring.json``: ``{"keys": [{"key_id", "role", "public_key": base64(raw 32 bytes), "not_after",
  "revoked"}]}``; verifiers use its ``role == "ledger"`` entries.

Deliberately tiny and exact to the file format, so a shared key module can replace it.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from proofline.errors import LedgerKeyUnavailable
from proofline.settings import Settings

ROLE = "ledger"


@dataclass(frozen=True)
class SigningKey:
    key_id: str
    private: Ed25519PrivateKey

    def sign(self, message: bytes) -> bytes:
        return self.private.sign(message)

    @property
    def public(self) -> Ed25519PublicKey:
        return self.private.public_key()


@dataclass(frozen=True)
class PublicKey:
    key_id: str
    public: Ed25519PublicKey
    not_after: datetime | None
    revoked: bool


def ledger_key_path(settings: Settings) -> Path | None:
    if settings.ledger_key_file is not None:
        return Path(settings.ledger_key_file)
    return Path(settings.keys_dir) / "ledger.key" if settings.keys_dir is not None else None


def keyring_path(settings: Settings) -> Path | None:
    # The keyring_file setting belongs to the envelope-signing work; use it when this build has it.
    explicit = getattr(settings, "keyring_file", None)
    if explicit is not None:
        return Path(explicit)
    return Path(settings.keys_dir) / "keyring.json" if settings.keys_dir is not None else None


def _read_json(path: Path | None, what: str) -> Any:
    if path is None:
        raise LedgerKeyUnavailable(f"no {what} configured (set PROOFLINE_KEYS_DIR)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LedgerKeyUnavailable(f"cannot read the {what} {path}: {exc}", path=str(path)) from None


def _raw(value: Any, what: str) -> bytes:
    try:
        raw = base64.b64decode(str(value), validate=True)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise LedgerKeyUnavailable(f"{what} is not base64 of 32 raw bytes")
    return raw


def load_signing_key(settings: Settings) -> SigningKey:
    path = ledger_key_path(settings)
    data = _read_json(path, "ledger key file")
    if not isinstance(data, dict) or data.get("role") != ROLE or not data.get("key_id"):
        raise LedgerKeyUnavailable(f"{path} is not a ledger key (role must be {ROLE!r})", path=str(path))
    seed = _raw(data.get("private_key"), f"{path}: private_key")
    return SigningKey(str(data["key_id"]), Ed25519PrivateKey.from_private_bytes(seed))


def load_public_keys(settings: Settings) -> dict[str, PublicKey]:
    """The keyring's ledger keys by key id (revoked and expired ones included, marked as such)."""
    path = keyring_path(settings)
    data = _read_json(path, "keyring")
    keys: dict[str, PublicKey] = {}
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise LedgerKeyUnavailable(f"{path} has no key list", path=str(path))
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("role") != ROLE:
            continue
        not_after = entry.get("not_after")
        try:
            expiry = datetime.fromisoformat(not_after) if not_after else None
            if expiry is not None and expiry.tzinfo is None:
                expiry = expiry.replace(tzinfo=UTC)  # a keyring time without a zone is UTC
        except (TypeError, ValueError):
            raise LedgerKeyUnavailable(f"{path}: not_after {not_after!r} is not ISO-8601") from None
        raw = _raw(entry.get("public_key"), f"{path}: public_key of {entry.get('key_id')}")
        keys[str(entry["key_id"])] = PublicKey(str(entry["key_id"]), Ed25519PublicKey.from_public_bytes(raw),
                                               expiry, bool(entry.get("revoked", False)))
    return keys
