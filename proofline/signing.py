"""Ed25519 envelope signatures with key ids and key roles.

The signature covers the RFC 8785 canonical JSON of the envelope document exactly as sent; the
worker checks it on the raw document *before* parsing, so no parsing quirk can make two different
documents verify. Controllers sign fresh actions with the controller key; recovery processes sign
derived envelopes (retry-free compensations, rollbacks, forward fixes) with the recovery key; workers
hold only the keyring of public keys, so nothing a worker host holds can mint an envelope.

Refusal order: shape, signature presence, key id known, key revoked, key expired, key role may sign
envelopes at all, canonical JSON, signature.

Retired is not revoked. A key past its ``not_after`` (rotated out) signs nothing new, but a message
the ledger stored before that moment stays the authority it was: a run's later step released after
the rotation, a re-drive of a message the broker lost, the parent a compensation derives from.
:func:`verify` accepts such a message when the caller says when the ledger stored it
(``stored_at``, from the database clock). A revoked key is refused whatever was stored. Whether the role fits the content (a fresh action or a
derived one) is checked once the envelope is parsed (:func:`check_role`).

Worker keys sign evidence statements only (:func:`sign_evidence`): what a worker recorded about an
action, which recovery verifies (:func:`verify_evidence`) before it derives or settles anything. The
signed bytes carry their own prefix, so an evidence signature is never a valid envelope signature,
and :func:`verify` refuses a worker key on any envelope whatever it signed.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cryptography.exceptions import InvalidSignature

from proofline.canonical import canonical_bytes, sha256_hex
from proofline.envelope import Envelope
from proofline.errors import (
    BadSignature,
    EvidenceUnsigned,
    ExpiredSigningKey,
    MalformedEnvelope,
    RevokedSigningKey,
    UnknownSigningKey,
    UnsignedEnvelope,
    WrongKeyRole,
)
from proofline.keys import Keyring, KeyRole, PublicKey, SigningKey

SIGNATURE_BYTES = 64
ENVELOPE_ROLES = (KeyRole.controller, KeyRole.recovery)
#: What a worker key's signature covers: this prefix, then the statement's canonical JSON.
EVIDENCE_CONTEXT = b"proofline-evidence-v1\n"


@dataclass(frozen=True)
class Verified:
    """A verified message: the signed envelope document and the keyring entry that verified it."""

    document: dict[str, Any]
    key: PublicKey
    #: When the key had retired and the message was accepted as one the ledger stored before that.
    stored_before_retirement: datetime | None = None


def encode_signature(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def sign_document(document: dict[str, Any], key: SigningKey) -> dict[str, Any]:
    """Sign any document as given (tests use this to sign hostile documents with real keys)."""
    return {"envelope": document, "key_id": key.key_id, "signature": encode_signature(key.sign(canonical_bytes(document)))}


def check_role(envelope: Envelope, role: KeyRole) -> None:
    """A controller key signs fresh actions only; a recovery key signs derived envelopes only (with a
    parent link); no other role signs envelopes."""
    if role == KeyRole.controller and envelope.recovers is not None:
        raise WrongKeyRole("a controller key may not sign a derived recovery envelope", role=role.value)
    if role == KeyRole.recovery and (envelope.recovers is None or envelope.parent_message_hash is None):
        raise WrongKeyRole("a recovery key may not sign a fresh action", role=role.value)
    if role not in ENVELOPE_ROLES:
        raise WrongKeyRole(f"a {role.value} key may not sign envelopes", role=role.value)


def sign(envelope: Envelope, key: SigningKey) -> dict[str, Any]:
    """The message body a controller (or recovery process) publishes: envelope, key id, signature."""
    check_role(envelope, key.role)
    return sign_document(envelope.model_dump(mode="json"), key)


def message_hash(message: dict[str, Any]) -> str:
    """sha256 of a signed message's canonical JSON: what a derived envelope's parent link names."""
    return sha256_hex({"envelope": message["envelope"], "key_id": message["key_id"],
                       "signature": message["signature"]})


def _decode(signature: str) -> bytes:
    """Exactly one accepted spelling per signature: strict base64 of 64 bytes, re-encoding to itself."""
    try:
        raw = base64.b64decode(signature.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError):
        raise BadSignature("signature is not base64 of an Ed25519 signature") from None
    if len(raw) != SIGNATURE_BYTES or encode_signature(raw) != signature:
        raise BadSignature("signature is not base64 of an Ed25519 signature")
    return raw


def verify(message: Any, keyring: Keyring, now: datetime | None = None,
           stored_at: Callable[[], datetime | None] | None = None) -> Verified:
    """Return the signed envelope document and its key, or raise the precise refusal.

    ``stored_at`` is asked only when the key has retired (past ``not_after``): it returns when the
    ledger recorded exactly this signed message, or ``None`` when it never did. A message stored
    before the key retired is accepted; any other is refused as signed with an expired key."""
    if not isinstance(message, dict) or not isinstance(message.get("envelope"), dict):
        raise MalformedEnvelope("message is not an object with an 'envelope' object")
    signature = message.get("signature")
    key_id = message.get("key_id")
    if not signature or not key_id:
        raise UnsignedEnvelope("message has no signature or key id")
    if not isinstance(signature, str) or not isinstance(key_id, str):
        raise MalformedEnvelope("signature and key_id must be strings")
    key = keyring.get(key_id)
    if key is None:
        raise UnknownSigningKey(f"unknown signing key id {key_id[:64]!r}")
    if key.revoked:
        raise RevokedSigningKey(f"signing key {key_id} is revoked", key_id=key_id)
    stored = None
    if key.expired(now or datetime.now(UTC)):
        stored = stored_at() if stored_at is not None else None
        if stored is None or key.not_after is None or stored >= key.not_after:
            raise ExpiredSigningKey(f"signing key {key_id} expired at {key.not_after.isoformat()}", key_id=key_id,
                                    stored_at=stored.isoformat() if stored is not None else "never")
    if key.role not in ENVELOPE_ROLES:
        raise WrongKeyRole(f"key {key_id} is a {key.role.value} key; it may not sign envelopes", key_id=key_id)
    try:
        data = canonical_bytes(message["envelope"])
    except Exception as exc:  # rfc8785 refuses NaN, huge ints, non-str keys
        raise MalformedEnvelope(f"envelope is not canonicalisable JSON: {exc}") from exc
    try:
        key.public.verify(_decode(signature), data)
    except InvalidSignature:
        raise BadSignature("signature does not match the envelope content") from None
    return Verified(message["envelope"], key, stored)


def sign_evidence(statement: dict[str, Any], key: SigningKey) -> dict[str, Any]:
    """A worker's signed evidence statement: ``{"statement", "key_id", "signature"}``."""
    if key.role != KeyRole.worker:
        raise WrongKeyRole(f"a {key.role.value} key may not sign evidence", role=key.role.value)
    return {"statement": statement, "key_id": key.key_id,
            "signature": encode_signature(key.sign(EVIDENCE_CONTEXT + canonical_bytes(statement)))}


def signer(keyring: Keyring, key_id: str, role: KeyRole, what: str,
           refuse: Callable[[str, str], Exception]) -> PublicKey:
    """The keyring entry of ``key_id`` when it is a ``role`` key; else ``refuse(cause, detail)`` is raised
    (``unknown_key``, ``wrong_key_role``). ``what`` names the signed thing in the detail."""
    key = keyring.get(key_id)
    if key is None:
        raise refuse("unknown_key", f"{what} signed with unknown key {key_id[:64]!r}")
    if key.role != role:
        raise refuse("wrong_key_role", f"{what} signed with {key.role.value} key {key_id}, not a {role.value} key")
    return key


def verify_evidence(seal: Any, keyring: Keyring, stored_at: datetime | None, now: datetime | None = None) -> PublicKey:
    """The worker key that signed ``seal``, or :class:`EvidenceUnsigned` with its ``cause``.

    A key past its ``not_after`` still vouches for a statement the ledger stored (``stored_at``)
    before that moment; a revoked key vouches for nothing."""
    def refuse(cause: str, detail: str) -> EvidenceUnsigned:
        return EvidenceUnsigned(detail, cause=cause)

    if not isinstance(seal, dict) or not isinstance(seal.get("statement"), dict):
        raise refuse("missing", "no signed evidence statement")
    key_id, signature = seal.get("key_id"), seal.get("signature")
    if not isinstance(key_id, str) or not isinstance(signature, str):
        raise refuse("malformed", "evidence key_id and signature must be strings")
    key = signer(keyring, key_id, KeyRole.worker, "evidence", refuse)
    if key.revoked:
        raise refuse("revoked_key", f"evidence signed with revoked worker key {key_id}")
    if key.expired(now or datetime.now(UTC)) and (stored_at is None or stored_at >= key.not_after):  # type: ignore[operator]
        raise refuse("expired_key", f"evidence stored after worker key {key_id} retired")
    try:
        key.public.verify(_decode(signature), EVIDENCE_CONTEXT + canonical_bytes(seal["statement"]))
    except (BadSignature, InvalidSignature):
        raise refuse("bad_signature", "the evidence signature does not match its statement") from None
    except Exception as exc:  # noqa: BLE001 - rfc8785 refuses NaN, huge ints, non-str keys
        raise refuse("malformed", f"the evidence statement is not canonicalisable JSON: {exc}"[:300]) from None
    return key
