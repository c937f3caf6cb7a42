"""The message checks every party runs the same way: size, signature, schema v1, argument hash,
idempotency key and contract match (a controller before it records ``published``, a worker on every
delivery, recovery before it publishes a derived action). Pure: keys and contracts are read only
when a check asks for them, never at import.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from proofline.bounded import safe_repr, safe_str, stable_digest
from proofline.canonical import canonical_bytes
from proofline.contracts import Contract
from proofline.envelope import Envelope, arguments_hash, key_for
from proofline.errors import ArgumentHashMismatch, ContractMismatch, IdempotencyKeyMismatch, MalformedEnvelope
from proofline.keys import load_keyring
from proofline.settings import Settings
from proofline.signing import check_role, verify

MAX_MESSAGE_BYTES = 256 * 1024


def refusal_chain_id(message: Any) -> str:
    """The ledger chain for a refused message: a digest of what arrived, never the claimed action id,
    so that a forged message cannot write into a real action's chain."""
    try:
        raw = canonical_bytes(message)
    except Exception:  # noqa: BLE001 - anything at all must get a stable id
        try:
            raw = repr(message).encode(errors="replace")
        except Exception:  # noqa: BLE001 - repr recursed or refused a huge int: digest a bounded copy
            return "refused:" + stable_digest(message)[:40]
    return "refused:" + hashlib.sha256(raw).hexdigest()[:40]


def claimed_fields(message: Any) -> dict[str, Any]:
    """What a refused message claimed to be, bounded, for the refusal's evidence."""
    env = message.get("envelope") if isinstance(message, dict) else None
    if not isinstance(env, dict):
        return {}
    return {k: safe_str(v, 200) if isinstance(v := env.get(k), str) else safe_repr(v, 200)
            for k in ("action_id", "run_id", "tenant", "action_type") if k in env}


def validate_envelope(message: Any, settings: Settings, contract_lookup,
                      stored_at: Callable[[], datetime | None] | None = None) -> tuple[Envelope, Contract]:
    """Schema, signature, argument hash, idempotency key and contract: all or nothing."""
    try:
        size = len(json.dumps(message, default=str))
    except (TypeError, ValueError, RecursionError) as exc:
        raise MalformedEnvelope(f"message is not JSON: {safe_repr(exc)}") from exc
    if size > MAX_MESSAGE_BYTES:
        raise MalformedEnvelope(f"message is {size} bytes; the limit is {MAX_MESSAGE_BYTES}")
    verified = verify(message, load_keyring(settings.keyring_file, settings.environment), stored_at=stored_at)
    try:
        envelope = Envelope.model_validate(verified.document)
    except ValidationError as exc:
        raise MalformedEnvelope(f"envelope does not match schema v1: {exc.errors(include_url=False)[:3]}") from exc
    check_role(envelope, verified.key.role)
    if arguments_hash(envelope.arguments) != envelope.arguments_hash:
        raise ArgumentHashMismatch("arguments do not hash to arguments_hash")
    if key_for(envelope) != envelope.idempotency_key:
        raise IdempotencyKeyMismatch("idempotency key differs from the one derived from the envelope")
    contract: Contract = contract_lookup(envelope.action_type)
    mismatches = {
        name: (have, want)
        for name, have, want in (
            ("tool", envelope.tool.name, contract.tool),
            ("server", envelope.server.name, contract.server),
            ("operation", envelope.operation, contract.operation),
            ("target_type", envelope.target.type, contract.target_type),
        )
        if have != want
    }
    if mismatches:
        raise ContractMismatch(f"envelope does not match contract {contract.action_type} v{contract.version}",
                               mismatches=mismatches)
    return envelope, contract
