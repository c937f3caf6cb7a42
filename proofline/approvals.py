"""Approvals as signed attestations: who approved exactly what, until when, within which scope.

An approval is a statement signed by an ``approver`` key (a person or an approval service; never a
worker, a controller's automation or recovery). It binds the intent it approves: action type,
tenant, environment, target and its reviewed version, the arguments hash, the tool contract hash,
and the plan hash when the approver saw a plan. The controller only carries approvals inside the
envelope it signs; its own signature says "I request this", never "this was approved".

The worker checks every approval an action carries (:func:`verify_approvals`): signature and key
role against the keyring, the approver named by the statement is the key's identity, every bound
field equals the envelope's, not expired, not revoked one by one, the scope covers what the action
does (a point of no return, an amount), and enough distinct approvers signed. Any approval that
fails refuses the action with that approval's reason: an action never runs on the good half of a
bad set.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from proofline.canonical import canonical_bytes
from proofline.envelope import Envelope, TargetResource
from proofline.errors import (
    ApprovalExpired,
    ApprovalMismatch,
    ApprovalMissing,
    ApprovalRevoked,
    ApprovalScopeExceeded,
    ApprovalSignatureInvalid,
    ApprovalWrongRole,
    ApproversInsufficient,
)
from proofline.keys import Keyring, KeyRole, SigningKey
from proofline.signing import _decode, encode_signature

KIND = "proofline.approval/v1"
#: How many approvals one action may carry (two-person rules need two; more is noise or an attack).
MAX_APPROVALS = 5


class ApprovalScope(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The approver accepted that this action cannot be undone (required for a point of no return).
    covers_irreversible: bool = False
    #: The largest amount of money (cents) this approval lets the action move; ``None``: no money.
    max_amount_cents: int | None = Field(default=None, ge=0)


class ApprovalStatement(BaseModel):
    """What an approver signs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["proofline.approval/v1"] = KIND
    approval_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/-]+$")
    #: The one action this approval is for; ``None`` approves the intent for whichever action carries it.
    action_id: str | None = Field(default=None, max_length=200)
    action_type: str = Field(min_length=1, max_length=200)
    tenant: str = Field(min_length=1, max_length=200)
    environment: str = Field(min_length=1, max_length=100)
    target: TargetResource
    arguments_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    tool_contract_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    #: The plan the approver reviewed (``proofline/plan.py``); the commit refuses any other.
    plan_hash: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    scope: ApprovalScope = ApprovalScope()
    approver: str = Field(min_length=1, max_length=200)
    issued_at: datetime
    expires_at: datetime

    @field_validator("issued_at", "expires_at")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("times must carry a time zone")
        return value


def statement_for(envelope: Envelope, *, approver: str, ttl: timedelta = timedelta(hours=1),
                  plan_hash: str | None = None, scope: ApprovalScope | None = None,
                  for_action: bool = True, approval_id: str | None = None) -> ApprovalStatement:
    """The statement approving exactly ``envelope``'s intent (what a reviewer tool or the CLI signs)."""
    now = datetime.now(UTC)
    return ApprovalStatement(
        approval_id=approval_id or f"apv-{now:%Y%m%d}-{secrets.token_hex(6)}",
        action_id=envelope.action_id if for_action else None, action_type=envelope.action_type,
        tenant=envelope.tenant, environment=envelope.environment, target=envelope.target,
        arguments_hash=envelope.arguments_hash, tool_contract_hash=envelope.tool.contract_hash,
        plan_hash=plan_hash, scope=scope or ApprovalScope(), approver=approver, issued_at=now, expires_at=now + ttl)


def sign_approval(statement: ApprovalStatement, key: SigningKey) -> dict[str, Any]:
    """``{"approval": statement, "key_id", "signature"}``, signed over the statement's canonical JSON."""
    if key.role != KeyRole.approver:
        raise ApprovalWrongRole(f"a {key.role.value} key may not sign approvals", key_id=key.key_id)
    document = statement.model_dump(mode="json")
    return {"approval": document, "key_id": key.key_id, "signature": encode_signature(key.sign(canonical_bytes(document)))}


def verify_one(signed: Any, keyring: Keyring) -> tuple[ApprovalStatement, str]:
    """The statement and the approver identity of one signed approval, or its refusal."""
    if not isinstance(signed, dict) or not isinstance(signed.get("approval"), dict):
        raise ApprovalSignatureInvalid("an approval is an object with an 'approval' statement")
    key_id, signature = signed.get("key_id"), signed.get("signature")
    if not isinstance(key_id, str) or not isinstance(signature, str):
        raise ApprovalSignatureInvalid("an approval carries a key_id and a signature")
    key = keyring.get(key_id)
    if key is None or key.revoked:
        raise ApprovalSignatureInvalid(f"approval signed with {'a revoked' if key else 'an unknown'} key "
                                       f"{key_id[:64]!r}", key_id=key_id[:64])
    if key.role != KeyRole.approver:
        raise ApprovalWrongRole(f"approval signed by a {key.role.value} key; only approver keys approve",
                                key_id=key_id, role=key.role.value)
    try:
        data = canonical_bytes(signed["approval"])
        key.public.verify(_decode(signature), data)
    except InvalidSignature:
        raise ApprovalSignatureInvalid("approval signature does not match its statement", key_id=key_id) from None
    except Exception as exc:  # noqa: BLE001 - an undecodable signature or statement is a bad signature
        raise ApprovalSignatureInvalid(f"approval cannot be verified: {str(exc)[:200]}", key_id=key_id) from None
    try:
        statement = ApprovalStatement.model_validate(signed["approval"])
    except ValidationError as exc:
        raise ApprovalSignatureInvalid(f"approval statement is malformed: {str(exc)[:300]}", key_id=key_id) from None
    identity = key.identity or key.key_id
    if statement.approver != identity:
        raise ApprovalMismatch(f"approval {statement.approval_id} names approver {statement.approver!r}; its key "
                               f"belongs to {identity!r}", approval_id=statement.approval_id, fields="approver")
    return statement, identity


def _mismatches(statement: ApprovalStatement, envelope: Envelope, plan_hash: str | None) -> list[str]:
    want = {"action_type": envelope.action_type, "tenant": envelope.tenant, "environment": envelope.environment,
            "target": envelope.target.model_dump(mode="json"), "arguments_hash": envelope.arguments_hash,
            "tool_contract_hash": envelope.tool.contract_hash}
    have = statement.model_dump(mode="json")
    fields = [name for name, value in want.items() if have[name] != value]
    if statement.action_id is not None and statement.action_id != envelope.action_id:
        fields.append("action_id")
    if statement.plan_hash is not None and statement.plan_hash != plan_hash:
        fields.append("plan_hash")
    return fields


def verify_approvals(signed: Sequence[Any], envelope: Envelope, keyring: Keyring, *, now: datetime,
                     revoked: Mapping[str, str], required: int = 1, irreversible: bool = False,
                     amount_cents: int | None = None, plan_hash: str | None = None) -> dict[str, Any]:
    """Every approval valid for this envelope and enough distinct approvers; returns the evidence.

    ``revoked`` maps revoked approval ids to their reasons; ``now`` is the database clock;
    ``plan_hash`` the plan the worker holds for this action (an approval of a plan binds to it)."""
    if not signed:
        raise ApprovalMissing("this action needs an approval signed by an approver; it carries none",
                              required=required)
    if len(signed) > MAX_APPROVALS:
        raise ApprovalSignatureInvalid(f"an action carries at most {MAX_APPROVALS} approvals, not {len(signed)}")
    approvers: dict[str, str] = {}
    for item in signed:
        statement, identity = verify_one(item, keyring)
        aid = statement.approval_id
        if statement.approval_id in revoked:
            raise ApprovalRevoked(f"approval {aid} was revoked: {revoked[aid]}"[:300], approval_id=aid)
        if statement.expires_at <= now:
            raise ApprovalExpired(f"approval {aid} expired at {statement.expires_at.isoformat()}", approval_id=aid)
        if statement.issued_at > now + timedelta(minutes=5):
            raise ApprovalMismatch(f"approval {aid} is issued in the future", approval_id=aid, fields="issued_at")
        fields = _mismatches(statement, envelope, plan_hash)
        if fields:
            raise ApprovalMismatch(f"approval {aid} approves another intent: {', '.join(fields)} differ",
                                   approval_id=aid, fields=",".join(fields))
        if irreversible and not statement.scope.covers_irreversible:
            raise ApprovalScopeExceeded(f"approval {aid} does not cover a point of no return (compensation not "
                                        "available)", approval_id=aid, compensation="not available")
        limit = statement.scope.max_amount_cents
        if amount_cents is not None and (limit is None or amount_cents > limit):
            raise ApprovalScopeExceeded(f"approval {aid} covers at most {limit} cents; the action moves {amount_cents}",
                                        approval_id=aid, amount_cents=amount_cents)
        approvers.setdefault(identity, aid)
    if len(approvers) < required:
        raise ApproversInsufficient(f"{required} distinct approvers required; {len(approvers)} approved "
                                    f"({', '.join(sorted(approvers))})", required=required, approvers=len(approvers))
    return {"approvers": sorted(approvers), "approval_ids": sorted(approvers.values()), "required": required}
