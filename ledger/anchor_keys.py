"""The ledger's Ed25519 keys for checkpoints, read through the one key module (``proofline/keys.py``):
``ledger.key`` (held only by the processes that write checkpoints) and the keyring's ``ledger``
entries (every verifier). Failures are :class:`LedgerKeyUnavailable`, so a worker without the key
refuses a checkpoint with a clear code instead of failing."""

from __future__ import annotations

from pathlib import Path

from proofline.errors import ConfigurationError, LedgerKeyUnavailable
from proofline.keys import KeyRole, PublicKey, SigningKey, load_keyring
from proofline.keys import load_signing_key as _load_key
from proofline.settings import Settings

__all__ = ["PublicKey", "SigningKey", "ledger_key_path", "load_public_keys", "load_signing_key"]


def ledger_key_path(settings: Settings) -> Path | None:
    if settings.ledger_key_file is not None:
        return Path(settings.ledger_key_file)
    return Path(settings.keys_dir) / "ledger.key" if settings.keys_dir is not None else None


def load_signing_key(settings: Settings) -> SigningKey:
    path = ledger_key_path(settings)
    try:
        return _load_key(path, KeyRole.ledger, settings.environment)
    except ConfigurationError as exc:
        raise LedgerKeyUnavailable(f"ledger key file unavailable: {exc.detail}", path=str(path)) from None


def load_public_keys(settings: Settings) -> dict[str, PublicKey]:
    """The keyring's ledger keys by key id (revoked and expired ones included, marked as such)."""
    try:
        ring = load_keyring(settings.keyring_file, settings.environment)
    except ConfigurationError as exc:
        raise LedgerKeyUnavailable(f"keyring unavailable: {exc.detail}") from None
    return {key_id: key for key_id, key in ring.keys.items() if key.role == KeyRole.ledger}
