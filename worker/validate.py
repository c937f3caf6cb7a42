"""Stage 1 and 2: validate the envelope (schema, signature, key) and revalidate it against the
current world (approval, deadline, policy, identities, kill switches, live server and tool).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from ledger.store import ActionRow
from proofline import validation
from proofline.canonical import canonical_bytes
from proofline.contracts import Contract
from proofline.envelope import DERIVED_KINDS, Envelope, derived_action_id
from proofline.errors import (
    MESSAGE_REFUSALS,
    ApprovalExpired,
    DeadlinePassed,
    EnvelopeRefused,
    EnvironmentMismatch,
    IdentityRevoked,
    KillSwitchEngaged,
    MessageRefused,
    ParentLinkInvalid,
    ParentRowMismatch,
    ParentSignatureInvalid,
    PolicyVersionRejected,
    ServerVersionChanged,
    ToolContractChanged,
    UnknownTool,
    WrongKeyRole,
)
from proofline.keys import Keyring, KeyRole
from proofline.settings import Settings
from proofline.signing import check_role, message_hash, verify
from proofline.validation import MAX_MESSAGE_BYTES, claimed_fields  # noqa: F401 - shared with the worker's callers
from worker.wire import RefusedBody


def refusal_chain_id(message: Any) -> str:
    """The refusal chain of a message; a body the wire format refused has its digest already."""
    if isinstance(message, RefusedBody):
        return "refused:" + message.digest[:40]
    return validation.refusal_chain_id(message)


def validate_envelope(message: Any, settings: Settings, contract_lookup,
                      stored_at: Callable[[], datetime | None] | None = None) -> tuple[Envelope, Contract]:
    """Stage 1: a body the wire format refused raises its refusal; anything else goes through the
    shared checks (``proofline/validation.py``)."""
    if isinstance(message, RefusedBody):
        raise MESSAGE_REFUSALS.get(message.reason, MessageRefused)(
            message.detail, message_digest=message.digest, message_bytes=message.size, excerpt=message.excerpt)
    return validation.validate_envelope(message, settings, contract_lookup, stored_at=stored_at)


def _canonical_or_repr(value: Any) -> bytes:
    try:
        return canonical_bytes(value)
    except Exception:  # noqa: BLE001 - a hostile row may hold anything; it then simply does not match
        return repr(value).encode()


def authenticate_row(row: ActionRow, keyring: Keyring, role: KeyRole) -> Envelope:
    """The envelope a stored action row really carries: its stored signed message verified against
    the keyring (signed by ``role``), and the row's own columns equal to what that message says.

    A row the runtime did not write (a forged INSERT, an edited column) fails here, so nothing is
    ever derived from it."""
    message = row.signed_message
    if message is None:
        raise ParentSignatureInvalid(f"action {row.action_id} has no signed message", action_id=row.action_id)
    try:
        # The row's own publication time: a message stored before its key retired still verifies.
        verified = verify(message, keyring, stored_at=lambda: row.published_at)
        envelope = Envelope.model_validate(verified.document)
        if verified.key.role != role:
            raise WrongKeyRole(f"signed by a {verified.key.role.value} key, not a {role.value} key")
        check_role(envelope, role)
    except (EnvelopeRefused, ValidationError) as exc:
        cause = exc.code if isinstance(exc, EnvelopeRefused) else "envelope_malformed"
        raise ParentSignatureInvalid(f"stored message of {row.action_id} does not verify: {exc}"[:500],
                                     action_id=row.action_id, cause=cause) from None
    stored = row.envelope if isinstance(row.envelope, dict) else {}
    mismatches = {
        name: (str(have)[:100], str(want)[:100])
        for name, have, want in (
            ("action_id", row.action_id, envelope.action_id),
            ("run_id", row.run_id, envelope.run_id),
            ("tenant", row.tenant, envelope.tenant),
            ("action_type", row.action_type, envelope.action_type),
            ("tool", row.tool, envelope.tool.name),
            ("idempotency_key", row.idempotency_key, envelope.idempotency_key),
            ("target", _canonical_or_repr(stored.get("target")), _canonical_or_repr(verified.document.get("target"))),
        )
        if have != want
    }
    if mismatches:
        raise ParentRowMismatch(f"action row {row.action_id} differs from its signed message",
                                action_id=row.action_id, mismatches=mismatches)
    return envelope


def check_parent_link(envelope: Envelope, parent_row: ActionRow | None, keyring: Keyring, contract_lookup) -> dict:
    """A recovery-signed envelope is executed only when its parent is a stored, controller-signed
    action whose message hashes to ``parent_message_hash``, of the same tenant, whose contract
    declares this action type as the recovery this envelope's id names."""
    def refuse(reason: str, detail: str) -> ParentLinkInvalid:
        return ParentLinkInvalid(f"recovery envelope {envelope.action_id}: {detail}", reason=reason,
                                 parent=str(envelope.recovers))

    if parent_row is None:
        raise refuse("parent_missing", f"parent {envelope.recovers} is not recorded")
    try:
        parent = authenticate_row(parent_row, keyring, KeyRole.controller)
    except (ParentSignatureInvalid, ParentRowMismatch) as exc:
        raise refuse(exc.code, exc.detail) from None
    if message_hash(parent_row.signed_message or {}) != envelope.parent_message_hash:
        raise refuse("parent_hash_mismatch", "parent_message_hash does not match the parent's signed message")
    if parent.tenant != envelope.tenant:
        raise refuse("tenant_mismatch", f"parent is tenant {parent.tenant!r}, this envelope {envelope.tenant!r}")
    recovery = contract_lookup(parent.action_type).recovery
    kind = next((k for k in DERIVED_KINDS if envelope.action_id == derived_action_id(parent.action_id, k)), None)
    spec = getattr(recovery, kind) if kind else None
    if spec is None or spec.action_type != envelope.action_type:
        raise refuse("recovery_not_declared", f"{parent.action_type}'s contract declares no {kind or 'recovery'} "
                     f"of type {envelope.action_type}")
    return {"parent": parent.action_id, "kind": kind, "parent_message_hash": envelope.parent_message_hash,
            "parent_action_type": parent.action_type}


def tool_switches(envelope: Envelope, suffix: str = "") -> list[str]:
    """The values of the tool kill switches that cover this envelope's tool (``suffix``: its
    ``@tenant`` for the per-tenant scope): this server's tool, and that tool on every server."""
    return [f"{envelope.server.name}:{envelope.tool.name}{suffix}", f"*:{envelope.tool.name}{suffix}"]


def revalidate_static(envelope: Envelope, settings: Settings, now: datetime, revoked: list[str],
                      kill_switches: list[dict[str, Any]]) -> dict[str, Any]:
    """Checks that need no MCP call; ``now`` is the database clock."""
    if envelope.environment != settings.environment:
        # A staging approval is no authority in production (and the reverse).
        raise EnvironmentMismatch(f"envelope approved for environment {envelope.environment[:100]!r}; this "
                                  f"worker runs {str(settings.environment)!r}")
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
            "environment": envelope.environment, "checked_at": now.isoformat()}


def revalidate_live(envelope: Envelope, live_version: str | None, expected_version: str | None,
                    live_hashes: dict[str, str]) -> dict[str, Any]:
    """Compare the approved server version and tool contract hash with what the live server says."""
    if live_version != envelope.server.version or (expected_version and live_version != expected_version):
        raise ServerVersionChanged(f"server {envelope.server.name} is {live_version!r}, approved "
                                   f"{envelope.server.version!r}")
    live_hash = live_hashes.get(envelope.tool.name)
    if live_hash is None:
        raise UnknownTool(f"server {envelope.server.name} has no tool {envelope.tool.name!r} (it lists: "
                          f"{', '.join(sorted(live_hashes)) or 'none'})")
    if live_hash != envelope.tool.contract_hash:
        raise ToolContractChanged(f"tool {envelope.tool.name} hashes to {live_hash}, approved "
                                  f"{envelope.tool.contract_hash}")
    return {"server_version": live_version, "tool_contract_hash": live_hash}
