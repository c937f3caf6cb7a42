"""The authority policy: how much each action type may do without a human, signed by an approver.

Authority grows in rungs (the seed's last practice): ``read`` → ``simulate`` → ``propose`` →
``approved`` → ``autonomous``. The policy names each action type's rung, how many distinct
approvers an approval needs, and, for bounded autonomy, the bounds inside which no human is asked.
It is a YAML file that an approver signs (``proofline authority sign``) into a JSON document
``{"policy", "key_id", "signature"}``; every process verifies that signature against the keyring
(role ``approver``) and records the policy's hash with every action it authorizes, so a change of
policy is visible in the ledger. A worker never trusts a policy file that no approver signed.

Where no policy is configured, development and test keep the controller's approval as the only
authority (recorded as mode ``unmanaged`` on every action); production refuses to run without one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from proofline.canonical import canonical_bytes, sha256_hex
from proofline.conditions import compile_expression
from proofline.errors import AuthorityPolicyInvalid, ConditionError
from proofline.keys import PRODUCTION, Keyring, KeyRole, SigningKey, load_keyring
from proofline.signing import _decode, encode_signature

KIND = "proofline.authority/v1"


class AuthorityMode(str, Enum):
    """The rungs of authority, lowest first."""

    #: Only tools the server declares read-only (``readOnlyHint``) may run; a write is refused.
    read = "read"
    #: The plan is prepared and recorded; nothing is committed.
    simulate = "simulate"
    #: The plan is prepared and waits as ``proposed`` until an approver approves that exact plan.
    propose = "propose"
    #: The controller supplies approvals signed by approvers.
    approved = "approved"
    #: A standing approval (this signed policy) lets actions inside its bounds run without a human.
    autonomous = "autonomous"

    @property
    def rank(self) -> int:
        return list(AuthorityMode).index(self)


class Bounds(BaseModel):
    """Where bounded autonomy ends. Outside the bounds an action becomes a proposal, never a silent refusal."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    window_seconds: int = Field(default=3600, ge=1, le=30 * 86400)
    #: Actions of this type per tenant per window (this one included).
    max_actions_per_tenant: int | None = Field(default=None, ge=1)
    #: Money moved by one action (cents), for contracts that declare ``amount_cents``.
    max_amount_cents: int | None = Field(default=None, ge=0)
    #: CEL conditions over ``args``, ``target`` and ``envelope`` that must all hold.
    conditions: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _compiles(self) -> Bounds:
        for i, expr in enumerate(self.conditions):
            try:
                compile_expression(expr)
            except ConditionError as exc:
                raise ValueError(f"bounds.conditions.{i}: {exc.detail}") from None
        return self


class ActionAuthority(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: AuthorityMode
    #: Distinct approver identities an approval of this type needs (two-person rule: 2).
    approvers_required: int = Field(default=1, ge=1, le=5)
    bounds: Bounds | None = None
    #: Required to make a point of no return or a destructive tool autonomous: why it is acceptable.
    autonomous_reason: str | None = Field(default=None, min_length=10, max_length=500)
    #: Where the runtime demotes this type on a regression (an outcome left unresolved, a failed
    #: compensation, a post-condition regression) among actions it authorized above that rung under
    #: this policy; ``None``: never automatically.
    demote_to: AuthorityMode | None = AuthorityMode.propose
    #: How this type's recovery actions (compensation, rollback, forward fix) are authorized: run
    #: automatically, or proposed to an approver first. A kind not named here is proposed when this
    #: type moves money or is a point of no return, and automatic otherwise.
    recovery: dict[Literal["compensation", "rollback", "forward"], Literal["automatic", "proposed"]] = {}

    @model_validator(mode="after")
    def _autonomy_has_bounds(self) -> ActionAuthority:
        if self.mode == AuthorityMode.autonomous and self.bounds is None:
            raise ValueError("an autonomous action type needs bounds (bounded autonomy only)")
        return self


class Promotion(BaseModel):
    """The evidence ``proofline authority promote`` requires before an action type moves up a rung."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    window_days: int = Field(default=30, ge=1, le=365)
    min_verified: int = Field(default=200, ge=0)
    max_open_unknown: int = Field(default=0, ge=0)
    max_verification_failures: int = Field(default=0, ge=0)
    min_compensation_success: float = Field(default=1.0, ge=0, le=1)


class AuthorityPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = KIND
    #: Raised by whoever edits the policy; recorded with every action it authorized.
    version: int = Field(ge=1)
    #: The rung of every action type the policy does not name.
    default_mode: AuthorityMode = AuthorityMode.approved
    action_types: dict[str, ActionAuthority] = {}
    promotion: Promotion = Promotion()

    @model_validator(mode="after")
    def _default_is_not_autonomy(self) -> AuthorityPolicy:
        if self.default_mode == AuthorityMode.autonomous:
            raise ValueError("default_mode cannot be autonomous: autonomy is granted per action type, with bounds")
        return self

    def for_type(self, action_type: str) -> ActionAuthority:
        return self.action_types.get(action_type) or ActionAuthority(mode=self.default_mode)


@dataclass(frozen=True)
class SignedPolicy:
    policy: AuthorityPolicy
    #: sha256 of the signed policy document: what the ledger records with every authorized action.
    hash: str
    key_id: str
    signed_by: str


def read_policy_yaml(path: Path) -> AuthorityPolicy:
    """A policy as written by people, refused with the field (or YAML line) at fault."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
        return AuthorityPolicy.model_validate(raw)
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else "?"
        raise AuthorityPolicyInvalid(f"{path}: not valid YAML at line {line}: {exc.problem}", file=str(path)) from None
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "policy"
        raise AuthorityPolicyInvalid(f"{path}: {where}: {first['msg']}", file=str(path)) from None
    except OSError as exc:
        raise AuthorityPolicyInvalid(f"{path} cannot be read: {exc}", file=str(path)) from None


def sign_policy(policy: AuthorityPolicy, key: SigningKey) -> dict[str, Any]:
    if key.role != KeyRole.approver:
        raise AuthorityPolicyInvalid(f"an authority policy is signed by an approver key, not a {key.role.value} key")
    document = policy.model_dump(mode="json")
    return {"policy": document, "key_id": key.key_id, "signature": encode_signature(key.sign(canonical_bytes(document)))}


def verify_policy(signed: Any, keyring: Keyring) -> SignedPolicy:
    """The policy a signed document holds, or ``authority_policy_invalid`` with the reason."""
    if not isinstance(signed, dict) or not isinstance(signed.get("policy"), dict):
        raise AuthorityPolicyInvalid("a signed authority policy is {\"policy\": ..., \"key_id\", \"signature\"}")
    key_id, signature = signed.get("key_id"), signed.get("signature")
    key = keyring.get(key_id) if isinstance(key_id, str) else None
    if key is None or key.revoked or key.role != KeyRole.approver:
        why = "unknown" if key is None else "revoked" if key.revoked else f"a {key.role.value} key"
        raise AuthorityPolicyInvalid(f"the authority policy is signed by {why} ({str(key_id)[:64]}); an active "
                                     "approver key must sign it")
    try:
        key.public.verify(_decode(str(signature)), canonical_bytes(signed["policy"]))
    except Exception:  # noqa: BLE001 - any failure to verify is the same refusal
        raise AuthorityPolicyInvalid("the authority policy's signature does not match its content") from None
    try:
        policy = AuthorityPolicy.model_validate(signed["policy"])
    except ValidationError as exc:
        raise AuthorityPolicyInvalid(f"the signed authority policy is malformed: {str(exc)[:300]}") from None
    return SignedPolicy(policy, sha256_hex(signed["policy"]), key.key_id, key.identity or key.key_id)


_cache: dict[str, tuple[tuple[int, int, int], SignedPolicy]] = {}


def load_policy(path: Path | None, keyring: Keyring, environment: str) -> SignedPolicy | None:
    """The signed policy at ``path`` (reloaded when the file or the keyring changes), ``None`` when
    none is configured outside production."""
    if path is None:
        if environment == PRODUCTION:
            raise AuthorityPolicyInvalid("production runs only under a signed authority policy: set "
                                         "PROOFLINE_AUTHORITY_FILE (proofline authority sign)")
        return None
    try:
        st = os.stat(path)
    except OSError as exc:
        raise AuthorityPolicyInvalid(f"authority policy {path} cannot be read: {exc.strerror}") from None
    stamp = (st.st_mtime_ns, st.st_size, id(keyring))
    hit = _cache.get(str(path))
    if hit is not None and hit[0] == stamp:
        return hit[1]
    try:
        signed = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise AuthorityPolicyInvalid(f"authority policy {path} is not JSON: {exc}") from None
    loaded = verify_policy(signed, keyring)
    _cache[str(path)] = (stamp, loaded)
    return loaded


def policy_in_force(settings: Any) -> SignedPolicy | None:
    """The signed policy a process with ``settings`` runs under (its keyring verifies it); ``None``
    without one outside production."""
    keyring = load_keyring(settings.keyring_file, settings.environment)
    return load_policy(settings.authority_file, keyring, settings.environment)

