"""Stage 1 and 2: validate the envelope (schema, signature, key) and revalidate it against the
current world (approval, deadline, policy, identities, kill switches, live server and tool).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from proofline.canonical import canonical_bytes
from proofline.contracts import Contract
from proofline.envelope import Envelope, arguments_hash, key_for
from proofline.errors import (
    MESSAGE_REFUSALS,
    ApprovalExpired,
    ArgumentHashMismatch,
    ContractMismatch,
    DeadlinePassed,
    IdempotencyKeyMismatch,
    IdentityRevoked,
    KillSwitchEngaged,
    MalformedEnvelope,
    MessageRefused,
    PolicyVersionRejected,
    ServerVersionChanged,
    ToolContractChanged,
)
from proofline.settings import Settings
from proofline.signing import verify
from worker.refusals import safe_repr, safe_str, stable_digest
from worker.wire import RefusedBody

MAX_MESSAGE_BYTES = 256 * 1024


def refusal_chain_id(message: Any) -> str:
    """The ledger chain for a refused message: a digest of what arrived, never the claimed action id,
    so that a forged message cannot write into a real action's chain."""
    if isinstance(message, RefusedBody):
        return "refused:" + message.digest[:40]
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


def validate_envelope(message: Any, settings: Settings, contract_lookup) -> tuple[Envelope, Contract]:
    """Schema, signature, argument hash, idempotency key and contract: all or nothing."""
    if isinstance(message, RefusedBody):
        raise MESSAGE_REFUSALS.get(message.reason, MessageRefused)(
            message.detail, message_digest=message.digest, message_bytes=message.size, excerpt=message.excerpt)
    try:
        size = len(json.dumps(message, default=str))
    except (TypeError, ValueError, RecursionError) as exc:
        raise MalformedEnvelope(f"message is not JSON: {safe_repr(exc)}") from exc
    if size > MAX_MESSAGE_BYTES:
        raise MalformedEnvelope(f"message is {size} bytes; the limit is {MAX_MESSAGE_BYTES}")
    document = verify(message, settings.signing_keys)
    try:
        envelope = Envelope.model_validate(document)
    except ValidationError as exc:
        raise MalformedEnvelope(f"envelope does not match schema v1: {exc.errors(include_url=False)[:3]}") from exc
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


def revalidate_static(envelope: Envelope, settings: Settings, now: datetime, revoked: list[str],
                      kill_switches: list[dict[str, Any]]) -> dict[str, Any]:
    """Checks that need no MCP call; ``now`` is the database clock."""
    if envelope.approval.expires_at <= now:
        raise ApprovalExpired(f"approval {envelope.approval.id} expired at {envelope.approval.expires_at.isoformat()}")
    if envelope.deadline <= now:
        raise DeadlinePassed(f"deadline {envelope.deadline.isoformat()} has passed")
    if envelope.policy_version not in settings.accepted_policy_versions:
        raise PolicyVersionRejected(f"policy version {envelope.policy_version} is not in "
                                    f"{settings.accepted_policy_versions}")
    if revoked:
        raise IdentityRevoked(f"revoked: {', '.join(sorted(revoked))}")
    if kill_switches:
        first = kill_switches[0]
        raise KillSwitchEngaged(f"kill switch {first['scope']}={first['value']} set by {first['set_by']}: "
                                f"{first['reason']}")
    return {"approval_expires_at": envelope.approval.expires_at.isoformat(), "policy_version": envelope.policy_version,
            "checked_at": now.isoformat()}


def revalidate_live(envelope: Envelope, live_version: str | None, expected_version: str | None,
                    live_hashes: dict[str, str]) -> dict[str, Any]:
    """Compare the approved server version and tool contract hash with what the live server says."""
    if live_version != envelope.server.version or (expected_version and live_version != expected_version):
        raise ServerVersionChanged(f"server {envelope.server.name} is {live_version!r}, approved "
                                   f"{envelope.server.version!r}")
    live_hash = live_hashes.get(envelope.tool.name)
    if live_hash != envelope.tool.contract_hash:
        raise ToolContractChanged(f"tool {envelope.tool.name} hashes to {live_hash}, approved "
                                  f"{envelope.tool.contract_hash}")
    return {"server_version": live_version, "tool_contract_hash": live_hash}
