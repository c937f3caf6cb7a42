"""The execution envelope: the signed, versioned statement of one authorized action.

The controller builds it with :func:`build_envelope`, which computes the argument hash and the
idempotency key in trusted code. The worker never trusts either value: it recomputes both and
refuses the envelope when they differ (see ``worker/validate.py``).
"""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from proofline.canonical import sha256_hex

SCHEMA_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CancellationBehaviour(str, Enum):
    """What the runtime does when a cancellation arrives for an in-flight action."""

    #: Signal the call, then reconcile downstream state before calling the action cancelled.
    reconcile = "reconcile"
    #: Signal the call, reconcile, and compensate any partial work the policy allows.
    reconcile_then_compensate = "reconcile_then_compensate"
    #: Do not signal the downstream call at all; only stop new work.
    finish_in_flight = "finish_in_flight"


class TargetResource(_Frozen):
    type: str = Field(min_length=1, max_length=100)
    id: str = Field(min_length=1, max_length=200)
    #: The version the approver reviewed; the precondition read must still see it.
    expected_version: str | int | None = None


#: The version recorded for a server that reports none (an empty version string, as the 2.x SDK's
#: ``MCPServer`` built without ``version=`` sends, or no server info at all). A value of its own,
#: visible in envelopes, pins and the ledger: the controller and the worker both record it, so an
#: unversioned server matches itself and never looks like a changed one.
NO_VERSION = "(no version)"


def reported_version(version: str | None) -> str:
    """A server's version as Proofline records it: exactly what the server reported, or
    :data:`NO_VERSION` when it reported none."""
    return version if version else NO_VERSION


class ServerRef(_Frozen):
    name: str = Field(min_length=1, max_length=100)
    version: str = Field(min_length=1, max_length=100)


class ToolRef(_Frozen):
    name: str = Field(min_length=1, max_length=200)
    #: sha256 of the tool's live definition (name, input and output schema, description, annotations)
    #: from ``tools/list``.
    contract_hash: str = Field(pattern=r"^[0-9a-f]{64}$")


class Approval(_Frozen):
    id: str = Field(min_length=1, max_length=200)
    version: int = Field(ge=1)
    expires_at: datetime
    #: True only when the approver explicitly accepted that this action cannot be undone.
    covers_irreversible: bool = False

    @field_validator("expires_at")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("expires_at must carry a time zone")
        return value


class AuthorityBudget(_Frozen):
    #: Tool calls this action may make in total, retries included.
    max_calls: int = Field(default=3, ge=1, le=20)
    #: Upper bound on any monetary amount in the arguments, when the action moves money.
    max_amount_cents: int | None = Field(default=None, ge=0)


class RetryPolicy(_Frozen):
    max_attempts: int = Field(default=2, ge=1, le=10)
    backoff_seconds: float = Field(default=1.0, ge=0, le=600)
    #: Retrying an unknown outcome blindly is never allowed; it is reconciled first.
    retry_unknown_outcome: Literal[False] = False


class EvidenceRequirements(_Frozen):
    record_precondition_snapshot: bool = True
    record_tool_result: bool = True
    #: Field names whose values are replaced by a redaction marker before anything is written.
    redact_fields: tuple[str, ...] = ("password", "token", "secret", "authorization", "api_key")


class Envelope(_Frozen):
    """One authorized action, bound to the exact technical call it allows."""

    schema_version: Literal[1] = SCHEMA_VERSION
    run_id: str = Field(min_length=1, max_length=200)
    action_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")
    #: Position of this action in its run (multi-step runs), starting at 0.
    step: int = Field(default=0, ge=0)
    #: How many steps the run has; steps run in order, each only after the previous one is verified.
    run_steps: int = Field(default=1, ge=1, le=100)
    workflow_type: str = Field(min_length=1, max_length=200)
    #: Names the action contract (``contracts/<action_type>.yaml``).
    action_type: str = Field(min_length=1, max_length=200)
    requester: str = Field(min_length=1, max_length=200)
    workload_identity: str = Field(min_length=1, max_length=200)
    tenant: str = Field(min_length=1, max_length=200)
    environment: str = Field(min_length=1, max_length=100)
    target: TargetResource
    operation: str = Field(min_length=1, max_length=100)
    arguments: dict[str, Any]
    arguments_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    server: ServerRef
    tool: ToolRef
    policy_version: int = Field(ge=1)
    approval: Approval
    #: Approvals signed by approvers (``proofline/approvals.py``), carried as they were signed. The
    #: controller's own ``approval`` above is its request context; these are the authority.
    approvals: tuple[dict[str, Any], ...] = Field(default=(), max_length=5)
    authority_budget: AuthorityBudget = AuthorityBudget()
    idempotency_key: str = Field(min_length=1, max_length=200)
    #: Extra CEL conditions the controller adds to the contract's preconditions.
    preconditions: tuple[str, ...] = ()
    #: Extra CEL conditions the controller adds to the contract's expected post-conditions.
    expected_postconditions: tuple[str, ...] = ()
    timeout_seconds: float = Field(gt=0, le=3600)
    deadline: datetime
    retry_policy: RetryPolicy = RetryPolicy()
    cancellation: CancellationBehaviour = CancellationBehaviour.reconcile
    compensation_ref: str | None = None
    #: Set on a recovery action (compensation, rollback, forward fix): the action it recovers.
    recovers: str | None = None
    #: On a recovery action only (and required there): sha256 of the canonical JSON of the parent's
    #: controller-signed message, so the executing worker can prove which authority it derives from.
    parent_message_hash: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    evidence: EvidenceRequirements = EvidenceRequirements()
    irreversible: bool = False

    @field_validator("deadline")
    @classmethod
    def _deadline_aware(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("deadline must carry a time zone")
        return value

    @model_validator(mode="after")
    def _parent_link_only_on_recovery(self) -> Envelope:
        if (self.recovers is None) != (self.parent_message_hash is None):
            raise ValueError("parent_message_hash is required on a recovery envelope (recovers set) "
                             "and allowed nowhere else")
        return self

    @field_validator("operation")
    @classmethod
    def _normalized_operation(cls, value: str) -> str:
        if value != value.strip().lower():
            raise ValueError("operation must be normalized (lower case, no surrounding space)")
        return value


#: The recovery actions a contract may declare (``recovery.<kind>``); derived action ids end in ``.<kind>``.
DERIVED_KINDS = ("compensation", "rollback", "forward")


def derived_action_id(action_id: str, kind: str) -> str:
    """A recovery action's id. Deterministic, so deciding twice never creates a second one."""
    return f"{action_id}.{kind}"


def arguments_hash(arguments: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of the arguments."""
    return sha256_hex(arguments)


def derive_idempotency_key(
    *,
    tenant: str,
    workflow_type: str,
    run_id: str,
    action_id: str,
    target_type: str,
    target_id: str,
    operation: str,
    argument_hash: str,
    approval_version: int,
) -> str:
    """The one idempotency key for this authorized intent.

    Built only from what identifies the intent: never a timestamp, never anything a model wrote,
    and identical on every retry of the same envelope.
    """
    material = {
        "tenant": tenant,
        "workflow_type": workflow_type,
        "run_id": run_id,
        "action_id": action_id,
        "target": [target_type, target_id],
        "operation": operation.strip().lower(),
        "arguments_hash": argument_hash,
        "approval_version": approval_version,
    }
    return "pl1-" + sha256_hex(material)[:48]


def key_for(envelope: Envelope) -> str:
    """Recompute the idempotency key an envelope must carry."""
    return derive_idempotency_key(
        tenant=envelope.tenant,
        workflow_type=envelope.workflow_type,
        run_id=envelope.run_id,
        action_id=envelope.action_id,
        target_type=envelope.target.type,
        target_id=envelope.target.id,
        operation=envelope.operation,
        argument_hash=envelope.arguments_hash,
        approval_version=envelope.approval.version,
    )


def build_envelope(**fields: Any) -> Envelope:
    """Build an envelope, computing its argument hash and idempotency key in trusted code.

    Callers pass every field except ``arguments_hash`` and ``idempotency_key``; passing either
    is refused so that no caller (and no model output) can choose them.
    """
    for forbidden in ("arguments_hash", "idempotency_key"):
        if forbidden in fields:
            raise ValueError(f"{forbidden} is computed by the controller, not supplied")
    fields["operation"] = str(fields["operation"]).strip().lower()
    digest = arguments_hash(fields["arguments"])
    target = fields["target"]
    target = target if isinstance(target, TargetResource) else TargetResource.model_validate(target)
    approval = fields["approval"]
    approval = approval if isinstance(approval, Approval) else Approval.model_validate(approval)
    key = derive_idempotency_key(
        tenant=fields["tenant"],
        workflow_type=fields["workflow_type"],
        run_id=fields["run_id"],
        action_id=fields["action_id"],
        target_type=target.type,
        target_id=target.id,
        operation=fields["operation"],
        argument_hash=digest,
        approval_version=approval.version,
    )
    return Envelope(**fields, arguments_hash=digest, idempotency_key=key)
