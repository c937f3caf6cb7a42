"""HMAC-SHA256 envelope signatures with key ids, so keys can rotate.

The signature covers the canonical JSON of the envelope exactly as sent; the worker checks it on
the raw document *before* parsing, so no parsing quirk can make two different documents verify.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from proofline.canonical import canonical_bytes
from proofline.envelope import Envelope
from proofline.errors import BadSignature, MalformedEnvelope, UnknownSigningKey, UnsignedEnvelope


def _mac(secret: str, document: dict[str, Any]) -> str:
    return hmac.new(secret.encode(), canonical_bytes(document), hashlib.sha256).hexdigest()


def sign(envelope: Envelope, keys: dict[str, str], key_id: str) -> dict[str, Any]:
    """The message body a controller publishes: the envelope, its key id and signature."""
    if key_id not in keys:
        raise UnknownSigningKey(f"no signing key {key_id!r}")
    document = envelope.model_dump(mode="json")
    return {"envelope": document, "key_id": key_id, "signature": _mac(keys[key_id], document)}


def verify(message: Any, keys: dict[str, str]) -> dict[str, Any]:
    """Return the signed envelope document, or raise the precise refusal."""
    if not isinstance(message, dict) or not isinstance(message.get("envelope"), dict):
        raise MalformedEnvelope("message is not an object with an 'envelope' object")
    signature = message.get("signature")
    key_id = message.get("key_id")
    if not signature or not key_id:
        raise UnsignedEnvelope("message has no signature or key id")
    if not isinstance(signature, str) or not isinstance(key_id, str):
        raise MalformedEnvelope("signature and key_id must be strings")
    secret = keys.get(key_id)
    if secret is None:
        raise UnknownSigningKey(f"unknown signing key id {key_id[:64]!r}")
    try:
        expected = _mac(secret, message["envelope"])
    except Exception as exc:  # rfc8785 refuses NaN, huge ints, non-str keys
        raise MalformedEnvelope(f"envelope is not canonicalisable JSON: {exc}") from exc
    # Compare bytes: a str comparison raises on non-ASCII input, and any input must be refused cleanly.
    if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "surrogatepass")):
        raise BadSignature("signature does not match the envelope content")
    return message["envelope"]
