"""Every status set Proofline stores, as ``str`` enums mirrored by Postgres ENUM types.

``tests/integration/test_ledger.py`` asserts that the Python and the migrated Postgres sets are
equal (``VerificationFinding`` is mirrored by the ``actions_finding_known`` CHECK).
"""

from __future__ import annotations

from enum import Enum


class Outcome(str, Enum):
    """What is known about the side effect of one action (the seed's ten result classes)."""

    #: Validation, authorization or a precondition failed before any side effect.
    not_started = "not_started"
    #: The downstream system accepted asynchronous work; it is tracked, not complete.
    accepted = "accepted"
    #: The expected post-condition exists and no prohibited change was found.
    completed_verified = "completed_verified"
    #: The server reported success but authoritative verification has not (yet) confirmed it.
    completed_unverified = "completed_unverified"
    #: Some approved steps happened and others did not.
    partially_completed = "partially_completed"
    #: No mutation occurred.
    failed_before_side_effect = "failed_before_side_effect"
    #: A mutation occurred and later processing failed.
    failed_after_side_effect = "failed_after_side_effect"
    #: The response path failed; whether the side effect happened is not known yet.
    unknown_outcome = "unknown_outcome"
    #: A recovery action restored an acceptable business state (closed as recovered, not as success).
    compensated = "compensated"
    #: A recovery action did not reach a safe state.
    compensation_failed = "compensation_failed"


class ActionStatus(str, Enum):
    """Where an action is in its lifecycle (independent of what is known about its effect)."""

    #: A later step of a run, recorded and waiting for the steps before it to be verified.
    pending = "pending"
    #: Recorded by the controller and sent to the broker.
    published = "published"
    #: Prepared and waiting for an approver to approve its exact plan (authority mode ``propose``, or
    #: an autonomous action outside its bounds); an approval sends it again, a denial closes it.
    proposed = "proposed"
    #: A worker holds the lease and is running the pre-call stages or the call.
    executing = "executing"
    #: The call is over; verification is reading the authoritative system.
    verifying = "verifying"
    #: Verification found the post-condition violated or never reached; recovery decides next.
    recovery = "recovery"
    #: Needs an operator: the final state could not be proven automatically.
    escalated = "escalated"
    #: Final: the outcome column holds the proven class.
    closed = "closed"
    #: Final: cancelled, and the external state is known (the outcome column says what it is).
    cancelled = "cancelled"


class IdempotencyStatus(str, Enum):
    """The state of the one record that answers for an idempotency key."""

    #: Claimed by a lease holder; a call may be in flight.
    in_progress = "in_progress"
    #: The effect is recorded (by a response or by reconciliation); later deliveries return it.
    completed = "completed"
    #: Proven to have made no side effect; a retry with the same key may claim it again.
    failed = "failed"
    #: The call's outcome is unknown; nothing may call again until reconciliation settles it.
    unknown = "unknown"


class VerificationFinding(str, Enum):
    """What the authoritative read showed."""

    #: Every expected condition holds and no prohibited one does.
    expected = "expected"
    #: Not yet expected, but inside the tolerated envelope (e.g. still warming up).
    tolerated = "tolerated"
    #: A prohibited condition holds.
    prohibited = "prohibited"
    #: The bound passed and the expected state was never seen.
    not_reached = "not_reached"
    #: The read shows the effect never happened.
    absent = "absent"
    #: The read path itself was unavailable until the bound.
    unavailable = "unavailable"
    #: Independent sources answered and disagree about the effect (every reading is kept).
    evidence_conflict = "evidence_conflict"


class RecheckStatus(str, Enum):
    """Where one scheduled post-condition re-check stands (``postcondition_checks.status``, a CHECK
    mirrors it; migration 0017)."""

    #: Waiting for its due time; nothing runs until then.
    scheduled = "scheduled"
    #: Taken by the reconciler and sent to a worker; taken again once its claim expires.
    claimed = "claimed"
    #: Read again: the post-condition still holds.
    held = "held"
    #: Read again: the post-condition no longer holds; the action went to recovery.
    regressed = "regressed"
    #: The read path (or a source) could not be read: no evidence either way.
    unreadable = "unreadable"
    #: Not read: the action regressed at an earlier re-check, or left its verified state.
    cancelled = "cancelled"
    #: Not read: its horizon passed before a worker could read it (the reconciler was down).
    expired = "expired"


class KillSwitchScope(str, Enum):
    """What a kill switch covers."""

    #: Every action.
    global_ = "global"
    #: One action type (contract).
    action_type = "action_type"
    #: One MCP tool of one server (value ``server:tool``; ``*:tool`` on every server).
    tool = "tool"
    #: One tenant.
    tenant = "tenant"
    #: One tool for one tenant (value ``server:tool@tenant``, ``*:`` for every server): what containment sets.
    tool_tenant = "tool_tenant"


class RecoveryKind(str, Enum):
    """The one recovery a recorded outcome leads to (chosen by policy, never by a model)."""

    #: Run the same envelope again with the same idempotency key.
    retry = "retry"
    #: Use the platform's own mechanism to restore the prior state.
    native_rollback = "native_rollback"
    #: A new, separately governed action that offsets the original.
    compensation = "compensation"
    #: Move forward from the intermediate state to a valid one without undoing.
    forward_recovery = "forward_recovery"
    #: Stop further damage (kill switch for the tool and tenant) and preserve the state.
    containment = "containment"
    #: Hand to an operator with the evidence.
    manual_intervention = "manual_intervention"


class CaptureKind(str, Enum):
    """What a row of the protected evidence store holds (``evidence_captures.kind``; a CHECK mirrors it)."""

    #: The tool's arguments exactly as sent.
    arguments = "arguments"
    #: The tool result's values as received.
    result = "result"
    #: The precondition read of the target, before the call.
    precondition_read = "precondition_read"
    #: A verification read of the target, after the call.
    verification_read = "verification_read"


#: Statuses in which no worker will advance the action without an operator or the reconciler.
SETTLED_STATUSES = frozenset({ActionStatus.closed, ActionStatus.cancelled, ActionStatus.escalated,
                              ActionStatus.recovery})


class RetentionClass(str, Enum):
    """How long a settled record is kept before ``proofline ledger prune`` may remove it (the
    durations are settings: ``retention_short_days``, ``retention_standard_days``,
    ``retention_audit_days``). Mirrored by the Postgres ENUM ``retention_class``."""

    #: Routine records worth little after a few days (delivery bookkeeping, test traffic).
    short = "short"
    #: The default for settled actions and their evidence.
    standard = "standard"
    #: Records an auditor may ask for years later.
    audit = "audit"
    #: Never pruned, whatever its age, until the hold is lifted.
    legal_hold = "legal_hold"
