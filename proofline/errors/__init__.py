"""Every error Proofline raises, each with a stable reason code.

One namespace, ``proofline.errors``; the module is split by audience to stay readable: the
runtime's refusals here, the authority's in ``errors/authority.py``, the operator's and the SDK's
in ``errors/operator.py``. Import every error from ``proofline.errors``.

The code is what lands in the ledger and what a controller branches on; the message is for
people. Retryable and terminal errors are distinct classes. All of them pickle cleanly because
Celery serialises exceptions across processes.
"""

class ProoflineError(Exception):
    """Proofline refused or could not complete a step."""

    code = "proofline_error"
    retryable = False

    def __init__(self, detail: str = "", **context: object) -> None:
        self.detail = detail or (self.__doc__ or "").strip()
        self.context = context
        super().__init__(detail, context)

    def __reduce__(self):  # keep pickling simple and lossless for Celery
        return (_rebuild, (type(self), self.detail, self.context))

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}"

    def as_evidence(self) -> dict[str, object]:
        return {"reason_code": self.code, "detail": self.detail, **{k: str(v) for k, v in self.context.items()}}


def _rebuild(cls: type[ProoflineError], detail: str, context: dict[str, object]) -> ProoflineError:
    return cls(detail, **context)


class ConfigurationError(ProoflineError):
    """The runtime is misconfigured."""

    code = "configuration_error"


# --- envelope refusals: the message never reaches a side effect -----------------------------


class EnvelopeRefused(ProoflineError):
    """The envelope was refused before any side effect."""

    code = "envelope_refused"


class MalformedEnvelope(EnvelopeRefused):
    """The envelope is not valid JSON of the expected shape."""

    code = "envelope_malformed"


class UnsignedEnvelope(EnvelopeRefused):
    """The envelope carries no signature."""

    code = "envelope_unsigned"


class UnknownSigningKey(EnvelopeRefused):
    """The envelope is signed with a key id this worker does not know."""

    code = "envelope_unknown_key"


class BadSignature(EnvelopeRefused):
    """The envelope's signature does not match its content (tampered)."""

    code = "envelope_bad_signature"


class ArgumentHashMismatch(EnvelopeRefused):
    """The arguments do not hash to the envelope's argument hash."""

    code = "envelope_argument_hash_mismatch"


class IdempotencyKeyMismatch(EnvelopeRefused):
    """The idempotency key is not the one trusted code derives from the envelope."""

    code = "envelope_idempotency_key_mismatch"


class UnknownActionType(EnvelopeRefused):
    """No action contract exists for the envelope's action type."""

    code = "unknown_action_type"


class ContractMismatch(EnvelopeRefused):
    """The envelope does not match its action contract (tool, server or operation)."""

    code = "contract_mismatch"


class ArgumentsInvalid(EnvelopeRefused):
    """The arguments do not satisfy the tool's input schema as pinned: refused before signing."""

    code = "arguments_invalid"


# --- revalidation: still authorized right now? ------------------------------------------------


class RevalidationFailed(ProoflineError):
    """The action is no longer authorized as approved."""

    code = "revalidation_failed"


class ApprovalExpired(RevalidationFailed):
    """The approval expired before execution."""

    code = "approval_expired"


class DeadlinePassed(RevalidationFailed):
    """The absolute deadline passed before execution."""

    code = "deadline_passed"


class PolicyVersionRejected(RevalidationFailed):
    """The envelope's policy version is not accepted by this runtime."""

    code = "policy_version_rejected"


class IdentityRevoked(RevalidationFailed):
    """The requester or workload identity has been revoked."""

    code = "identity_revoked"


class ServerVersionChanged(RevalidationFailed):
    """The live MCP server's version differs from the approved one."""

    code = "server_version_changed"


class ToolContractChanged(RevalidationFailed):
    """The live tool definition no longer hashes to the approved contract hash."""

    code = "tool_contract_changed"


class UnknownTool(RevalidationFailed):
    """The server has no tool by the name the action contract gives."""

    code = "unknown_tool"


class PointOfNoReturnRefused(RevalidationFailed):
    """An irreversible action is not cleared to pass its point of no return."""

    code = "point_of_no_return_refused"


class KillSwitchEngaged(RevalidationFailed):
    """A kill switch covers this action."""

    code = "kill_switch_engaged"


# --- preconditions ----------------------------------------------------------------------------


class PreconditionFailed(ProoflineError):
    """A precondition did not hold on the fresh authoritative read."""

    code = "precondition_failed"


class TargetReadFailed(ProoflineError):
    """The authoritative read of the target failed before execution."""

    code = "target_read_failed"
    retryable = True


class PrepareFailed(TargetReadFailed):
    """The contract's prepare tool gave no usable plan (unreachable, an error, too large, unreadable)."""

    code = "prepare_failed"
    retryable = True


# --- leases and idempotency -------------------------------------------------------------------


class LeaseBusy(ProoflineError):
    """Another live worker holds the lease on this action or its target."""

    code = "lease_busy"
    retryable = True


class StaleLease(ProoflineError):
    """A write was attempted under a fencing token that is no longer current."""

    code = "stale_fencing_token"


class SweepRunLost(ProoflineError):
    """A fleet-wide sweep run was no longer open when its holder finished it."""

    code = "sweep_run_lost"


class IdempotencyConflict(ProoflineError):
    """The idempotency key was reused with different arguments or contract."""

    code = "idempotency_conflict"


class ReplayWindowExpired(ProoflineError):
    """The idempotency record is older than the replay window."""

    code = "replay_window_expired"


class AbsoluteDeadlineReached(ProoflineError):
    """A call in flight was cut at the envelope's absolute deadline. Progress notifications restart
    the request timeout but never move the deadline; whatever the server did is unknown."""

    code = "absolute_deadline_reached"


class OperationRecordExpired(ProoflineError):
    """The downstream operation record (an asynchronous operation's status, an MCP Task) had expired
    before the runtime retrieved it: the outcome is settled from the authoritative read alone, and
    the expiry is kept as evidence."""

    code = "operation_record_expired"


class McpTaskExpired(ProoflineError):
    """The MCP Task that ran the call can no longer say what it did: its time to live passed, the
    server no longer knows it, or it ended without a result to retrieve. The call was sent, so the
    outcome is unknown and settled from the authoritative read; the expiry is kept as evidence."""

    code = "mcp_task_expired"


class TransitionRefused(ProoflineError):
    """A guarded state transition moved no row: the current state does not allow it."""

    code = "transition_refused"


# --- MCP ---------------------------------------------------------------------------------------


class McpUnavailable(ProoflineError):
    """The MCP server could not be reached before a request was sent."""

    code = "mcp_unavailable"
    retryable = True


class ServerAuthFailed(McpUnavailable):
    """No OAuth access token could be had for the server before a request was sent (the
    authorization server refused the client or its refresh token, or could not be reached)."""

    code = "server_auth_failed"
    retryable = True


class TokenExchangeRefused(ProoflineError):
    """The per-action token (OAuth 2.0 Token Exchange, RFC 8693) was not obtained or not accepted
    by the worker: the tools/call was not sent."""

    code = "token_exchange_refused"


class TokenExchangeFailed(TokenExchangeRefused):
    """The authorization server did not exchange the identity's token for a per-action token (it
    refused, answered with something that is not a token, or could not be reached): nothing was sent."""

    code = "token_exchange_failed"


class TokenExchangeTooBroad(TokenExchangeRefused):
    """The exchanged token carries a scope the worker did not ask for: it is not used, nothing was sent."""

    code = "token_exchange_too_broad"


class TokenExchangeTooLong(TokenExchangeRefused):
    """The exchanged token lives longer than the worker asked (or does not say how long it lives):
    it is not used, nothing was sent."""

    code = "token_exchange_too_long"


class ExtractionFailed(ProoflineError):
    """A value could not be read out of a tool result as the contract declares."""

    code = "extraction_failed"


class ConditionError(ProoflineError):
    """A contract condition could not be evaluated."""

    code = "condition_error"


# --- ledger checkpoints -----------------------------------------------------------------------


class LedgerKeyUnavailable(ConfigurationError):
    """The ledger signing key (or the keyring's ledger public key) is missing or unreadable."""

    code = "ledger_key_unavailable"


class CheckpointInvalid(ProoflineError):
    """A ledger checkpoint is malformed, its signature does not verify, or its content was altered."""

    code = "checkpoint_invalid"


class CheckpointExists(ProoflineError):
    """A checkpoint with this number is already in the store (another writer took it); nothing was overwritten."""

    code = "checkpoint_exists"
    retryable = True
# --- secrets and redaction ----------------------------------------------------------------------


class EnvironmentMismatch(RevalidationFailed):
    """The envelope was approved for another environment than this worker's (staging vs production)."""

    code = "environment_mismatch"


class SealedMessageUnreadable(ProoflineError):
    """A stored sealed signed message cannot be opened (no key loaded for it, or it fails authentication)."""

    code = "sealed_message_unreadable"
# --- database roles ---------------------------------------------------------------------------


class ActionNotPublished(EnvelopeRefused):
    """An execute message names an action no controller published: workers never create actions."""

    code = "action_not_published"


class PrivilegeRefused(ProoflineError):
    """Postgres refused a write this database role may not make (an illegal transition, an event
    reserved for another role, a row this role may not create). Never retried into success."""

    code = "privilege_refused"
# --- keys and signatures ----------------------------------------------------------------------


class RevokedSigningKey(EnvelopeRefused):
    """The envelope is signed with a key the keyring marks as revoked."""

    code = "envelope_key_revoked"


class ExpiredSigningKey(EnvelopeRefused):
    """The envelope is signed with a key past its ``not_after``."""

    code = "envelope_key_expired"


class WrongKeyRole(EnvelopeRefused):
    """The signing key's role may not sign this envelope: a recovery key signed a fresh action, a
    controller key signed a derived recovery envelope, or some other role signed an envelope."""

    code = "envelope_wrong_key_role"


class ParentLinkInvalid(EnvelopeRefused):
    """A recovery envelope's parent link does not hold: the parent is missing, not controller-signed,
    does not hash to ``parent_message_hash``, is another tenant's, or does not declare this recovery."""

    code = "envelope_parent_link_invalid"


class ParentSignatureInvalid(ProoflineError):
    """A stored action's signed message is missing, does not verify, or is signed by the wrong role:
    nothing may be derived from it."""

    code = "parent_signature_invalid"


class ParentRowMismatch(ProoflineError):
    """A stored action's columns (id, tenant, action type, tool, target, idempotency key) differ from
    the envelope its signed message carries: the row was not written by the runtime."""

    code = "parent_row_mismatch"


class EvidenceUnsigned(ParentSignatureInvalid):
    """No valid worker signature covers the evidence recovery would act on (``cause`` says why)."""

    code = "evidence_unsigned"


class EvidenceMismatch(ParentRowMismatch):
    """The action row's evidence columns differ from what the worker signed (the ``columns`` named)."""

    code = "evidence_mismatch"
# --- containment: conditions, outputs and budgets ---------------------------------------------


class LimitExceeded(RevalidationFailed):
    """The envelope asks for more than this runtime allows; refused before any effect."""

    code = "limit_exceeded"


class DeadlineTooFar(LimitExceeded):
    """The absolute deadline is further away than the runtime's maximum horizon."""

    code = "deadline_too_far"


class AuthorityBudgetExceeded(LimitExceeded):
    """The action (or its run so far) would exceed the envelope's authority budget."""

    code = "authority_budget_exceeded"


class ConditionTooComplex(ConditionError, LimitExceeded):
    """A CEL condition exceeds the static limits (size, nesting, terms, comprehensions)."""

    code = "condition_too_complex"


class ConditionInputTooLarge(ConditionError):
    """A comprehension would iterate over more items than the limit allows."""

    code = "condition_input_too_large"


class ContractInvalid(EnvelopeRefused):
    """The action type's contract file could not be loaded (the file and the reason are named)."""

    code = "contract_invalid"


class ResultTooLarge(ProoflineError):
    """A tool result is larger than the limit for its server and contract."""

    code = "result_too_large"


class SandboxAuditOverflow(ProoflineError):
    """The sandboxed server's audit lost lines during the call (lines dropped, or strace's output
    left unread when the session closed), and the server's ``sandbox.audit.on_overflow`` is
    ``fail_closed``: the call is not accepted on an incomplete audit. ``sent`` (in the context)
    says whether the request had left; when it had, whatever the server did is unknown."""

    code = "sandbox_audit_overflow"

    @property
    def sent(self) -> bool:
        return bool(self.context.get("sent", True))


class ConditionInvalid(LimitExceeded):
    """A condition the envelope adds does not compile."""

    code = "condition_invalid"
# --- containment: messages refused on the wire, deliveries that never settle ------------------


class MessageRefused(EnvelopeRefused):
    """The task message itself was unacceptable before any envelope could be read."""

    code = "message_refused"


class MessageTooLarge(MessageRefused):
    """The message body is larger than the wire limit."""

    code = "message_too_large"


class MessageTooDeep(MessageRefused):
    """The message body nests deeper than the wire limit."""

    code = "message_too_deep"


class MessageUndecodable(MessageRefused):
    """The message body is not UTF-8 JSON."""

    code = "message_undecodable"


class MessageMalformed(MessageRefused):
    """The message body or headers do not have the task protocol's shape."""

    code = "message_malformed"


class MessageContentRefused(MessageRefused):
    """The message has a content type the workers do not accept (only the Proofline wire format)."""

    code = "message_content_type_refused"


class MessageUnknownTask(MessageRefused):
    """The message names a task this worker does not run."""

    code = "message_unknown_task"


class MessageDeadLettered(MessageRefused):
    """The message was delivered too many times without reaching a recorded outcome."""

    code = "dead_lettered"


class DeadlineExpiredUnexecuted(ProoflineError):
    """The action's deadline (plus grace) passed while it was still waiting to execute."""

    code = "deadline_expired_unexecuted"


#: Refusal reason -> error class, for reasons decided outside an exception (the wire decoder).
MESSAGE_REFUSALS: dict[str, type[MessageRefused]] = {
    cls.code: cls for cls in (MessageTooLarge, MessageTooDeep, MessageUndecodable, MessageMalformed,
                              MessageContentRefused, MessageUnknownTask, MessageDeadLettered)
}


# --- recovery authority -----------------------------------------------------------------------


class RecoveryContractUnknown(ProoflineError):
    """Recovery found no recorded live contract for the recovery action's tool: recovery processes run
    no tool servers, so they derive only from what the parent's execution recorded."""

    code = "recovery_contract_unknown"


# --- tenant fairness and quotas ---------------------------------------------------------------


class TenantQuotaExceeded(ProoflineError):
    """The tenant already has ``tenant_max_executing`` actions executing: this one waits (it is
    delivered again shortly), it is never dropped."""

    code = "tenant_quota_wait"


class TenantFairWait(TenantQuotaExceeded):
    """The tenant has its fair share executing while another tenant waits on the same execute shard
    with fewer: this action yields its turn (requeued at the shard's tail at once), never dropped."""

    code = "tenant_fair_wait"


# The other parts of the one namespace (they subclass the classes above).
from proofline.errors.authority import *  # noqa: E402,F403
from proofline.errors.evidence_store import *  # noqa: E402,F403
from proofline.errors.operator import *  # noqa: E402,F403
