"""Sealing captured evidence to the auditor (hybrid encryption), and opening it again.

For each item a writer makes an ephemeral X25519 key pair, agrees a secret with the auditor's
public key, derives a one-time AES-256-GCM key from it with HKDF-SHA256 (salted with both public
keys) and encrypts. The row keeps the ciphertext, the ephemeral public key, the nonce and the
auditor key id; the writer forgets the ephemeral private key, so it cannot open what it sealed.

The associated data binds the ciphertext to where it belongs: the capture id, the action id, the
kind of item and the auditor key id. A blob copied to another row, action or kind fails
authentication. The plaintext is ``{"salt": …, "value": …}`` with 16 random bytes of salt, so
the digest the ledger records (``sha256`` of the plaintext) proves what was captured without
letting anyone confirm a guess of a short secret.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from proofline.auditor_keys import AuditorKey, AuditorPublicKey
from proofline.errors import AuditorKeyRequired, EvidenceCaptureTampered

FORMAT = "proofline-capture/1"
_INFO = b"proofline evidence capture v1"
NONCE_BYTES = 12
SALT_BYTES = 16


@dataclass(frozen=True)
class Sealed:
    """One sealed item, as the evidence store keeps it."""

    capture_id: str
    action_id: str
    kind: str
    key_id: str
    ephemeral_public: bytes
    nonce: bytes
    ciphertext: bytes
    #: ``sha256:<hex>`` of the plaintext (salt and value): what the ledger records.
    plaintext_sha256: str


def associated_data(capture_id: str, action_id: str, kind: str, key_id: str) -> bytes:
    """What the ciphertext is bound to (authenticated, not encrypted)."""
    return json.dumps({"format": FORMAT, "capture_id": capture_id, "action_id": action_id, "kind": kind,
                       "key_id": key_id}, sort_keys=True, separators=(",", ":")).encode()


def _key(shared: bytes, ephemeral_public: bytes, recipient_public: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=ephemeral_public + recipient_public,
                info=_INFO).derive(shared)


def plaintext(value: Any) -> bytes:
    """The bytes sealed for ``value``: a fresh salt and the value, as JSON (any value: what JSON
    cannot spell is kept as its string, a lone surrogate as its escape)."""
    salt = base64.b64encode(os.urandom(SALT_BYTES)).decode()
    return json.dumps({"salt": salt, "value": value}, sort_keys=True, separators=(",", ":"), default=str).encode()


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def seal(public: AuditorPublicKey, *, capture_id: str, action_id: str, kind: str, value: Any) -> Sealed:
    """Seal ``value`` to the auditor; only :func:`open_sealed` with the auditor's private key reads it."""
    data = plaintext(value)
    ephemeral = X25519PrivateKey.generate()
    eph_raw = ephemeral.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    key = _key(ephemeral.exchange(public.public), eph_raw, public.raw())
    nonce = os.urandom(NONCE_BYTES)
    ciphertext = AESGCM(key).encrypt(nonce, data, associated_data(capture_id, action_id, kind, public.key_id))
    return Sealed(capture_id, action_id, kind, public.key_id, eph_raw, nonce, ciphertext, digest(data))


def open_sealed(key: AuditorKey, item: Sealed) -> Any:
    """The value sealed in ``item``. Raises :class:`AuditorKeyRequired` when it was sealed to
    another auditor key, :class:`EvidenceCaptureTampered` when it fails authentication or its
    plaintext does not match its recorded digest."""
    if item.key_id != key.key_id:
        raise AuditorKeyRequired(f"capture {item.capture_id} is sealed to auditor key {item.key_id}; this key is "
                                 f"{key.key_id}", capture_id=item.capture_id)
    try:
        shared = key.private.exchange(X25519PublicKey.from_public_bytes(bytes(item.ephemeral_public)))
        aes = AESGCM(_key(shared, bytes(item.ephemeral_public), key.public.raw()))
        data = aes.decrypt(bytes(item.nonce), bytes(item.ciphertext),
                           associated_data(item.capture_id, item.action_id, item.kind, item.key_id))
    except (InvalidTag, ValueError) as exc:
        raise EvidenceCaptureTampered(f"capture {item.capture_id} of action {item.action_id} failed authentication "
                                      "(changed, or moved from another action or kind)",
                                      capture_id=item.capture_id, action_id=item.action_id) from exc
    if digest(data) != item.plaintext_sha256:
        raise EvidenceCaptureTampered(f"capture {item.capture_id} does not match its recorded digest",
                                      capture_id=item.capture_id, action_id=item.action_id)
    return json.loads(data)["value"]
