"""Least-privilege database roles and the rules Postgres enforces for them (migration 0003).

Python never decides what a role may write: these tables and functions are installed in the
database, and the triggers consult them on every write. The Python tuples below are the source
the migration inserts; ``tests/security/test_db_roles.py`` checks the migrated tables equal them.

Roles: ``proofline_controller`` publishes, ``proofline_worker`` executes and verifies,
``proofline_recovery`` is the worker plus publishing derived recovery actions,
``proofline_operator`` runs kill switches, revocations, cancellations and manual resolutions,
``proofline_reader`` only reads. ``proofline_runtime`` (development only) is worker + recovery.
``proofline_auditor`` (migration 0018) alone reads the protected evidence store, and appends the
``evidence_read_by_auditor`` event each read leaves.
"""

from __future__ import annotations

from typing import NamedTuple

CONTROLLER, WORKER, RECOVERY, OPERATOR, READER = (
    "proofline_controller", "proofline_worker", "proofline_recovery", "proofline_operator", "proofline_reader")
RUNTIME = "proofline_runtime"
#: Reads the protected evidence store and records each read (migration 0018); nothing else.
AUDITOR = "proofline_auditor"
ROLES = (CONTROLLER, WORKER, RECOVERY, OPERATOR, READER)

#: The kinds of derived recovery action (recovery/recover.py WORKFLOW values).
RECOVERY_ACTION_KINDS = ("compensation", "rollback", "forward")


class Transition(NamedTuple):
    """One legal move of an action's status. ``roles`` are role names without the ``proofline_``
    prefix; the resulting outcome must be one of ``outcomes``, or unchanged when ``keeps_outcome``;
    ``from_outcomes`` (when given) limits the outcome the action must have before the move."""

    from_status: str
    to_status: str
    roles: tuple[str, ...]
    keeps_outcome: bool
    outcomes: tuple[str, ...] = ()
    from_outcomes: tuple[str, ...] | None = None
    #: The migration that installs this rule when it is newer than migration 0003 (whose rows are
    #: every rule with ``since=None``): a status added later cannot appear in 0003's insert.
    since: str | None = None


W, R, OP = ("worker",), ("recovery",), ("operator",)
WO = ("worker", "operator")
CLASSIFIED = ("completed_unverified", "accepted", "failed_after_side_effect", "unknown_outcome")

#: Derived from every ``transition_txn`` call in worker/, recovery/ (and the operator paths).
ACTION_TRANSITIONS: tuple[Transition, ...] = (
    # execute (worker/execute.py): refusals before any effect, the claim, the classified call
    Transition("published", "closed", W, False, ("not_started", "failed_before_side_effect")),
    Transition("published", "cancelled", WO, False, ("not_started",)),
    Transition("published", "executing", W, True),
    Transition("executing", "executing", W, True),
    Transition("published", "verifying", W, True, ("unknown_outcome",)),
    Transition("executing", "verifying", W, False, CLASSIFIED),
    Transition("verifying", "verifying", W, True, ("unknown_outcome",)),
    Transition("published", "escalated", W, False, ("unknown_outcome",)),
    Transition("executing", "escalated", W, False, ("unknown_outcome",)),
    Transition("executing", "published", W, False, ("failed_before_side_effect",)),
    Transition("executing", "closed", W, False, ("failed_before_side_effect",)),
    # verify (recovery/verify.py): the verdict of the independent read
    Transition("verifying", "closed", W, False, ("completed_verified", "not_started")),
    Transition("verifying", "recovery", W, True, ("failed_after_side_effect", "failed_before_side_effect",
                                                  "completed_verified", "partially_completed")),
    Transition("verifying", "escalated", W, True, ("completed_unverified", "unknown_outcome")),
    Transition("verifying", "cancelled", W, False, ("failed_before_side_effect",)),
    # recover (recovery/recover.py): the decision, a retry of the same envelope
    Transition("recovery", "recovery", R, True),
    Transition("recovery", "published", R, True),
    # settle (recovery/settle.py): a recovery action settled; escalation by recover or settle
    Transition("recovery", "escalated", WO, True, ("compensation_failed",)),
    Transition("recovery", "closed", W, False, ("compensated",)),
    Transition("recovery", "cancelled", W, False, ("compensated",)),
    # runs (recovery/runs.py): release, abort, unwind a verified step
    Transition("pending", "published", W, True),
    Transition("pending", "closed", WO, False, ("not_started",)),
    Transition("closed", "recovery", WO, True, (), ("completed_verified",)),
    # operator (recovery/cancel.py, recovery/operator.py)
    Transition("pending", "cancelled", OP, False, ("not_started",)),
    Transition("escalated", "closed", OP, False, ("completed_verified", "failed_after_side_effect",
                                                 "failed_before_side_effect", "compensated")),
    # operator retry (recovery/operator_retry.py, migration 0010): an escalated action whose effect
    # is proven absent is sent again, as recovery's own retry does (recovery -> published)
    Transition("escalated", "published", OP, True, (), ("failed_before_side_effect",)),
    # authority (worker/authorize.py, recovery/proposals.py, migration 0015): a prepared action waits
    # for an approver; an approval sends it again, a denial (or its expiry) closes it before any effect
    Transition("published", "proposed", W, True, since="0015"),
    Transition("proposed", "published", OP, True, since="0015"),
    Transition("proposed", "closed", WO, False, ("not_started",), since="0015"),
)

#: Legal moves of an idempotency record (worker/execute.py claim/dispatch/result, verify's settle).
IDEMPOTENCY_TRANSITIONS: tuple[tuple[str, str], ...] = (
    ("in_progress", "in_progress"), ("in_progress", "completed"), ("in_progress", "failed"),
    ("in_progress", "unknown"),
    ("failed", "in_progress"), ("failed", "failed"), ("failed", "completed"),
    ("unknown", "unknown"), ("unknown", "completed"), ("unknown", "failed"),
    ("completed", "completed"), ("completed", "failed"),
)

#: Events only some roles may append. Any other event is the worker's (and so recovery's).
#: "recovery_derived": the recovery role, on the chain of a derived recovery action only.
EVENT_RIGHTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("published", ("controller", "recovery_derived")),
    ("pending", ("controller",)),
    ("republished", ("controller", "recovery_derived")),
    ("publish_refused", ("controller", "recovery_derived")),
    ("operator_intervention", OP),
    ("cancel_requested", OP),
    ("kill_switch_set", OP),
    ("kill_switch_cleared", OP),
    # revocations (recovery/operator.py, migration 0010), on the chain ``revocation:<identity>``
    ("identity_revoked", OP),
    ("revocation_lifted", OP),
    # follow-ups an operator's cancellation runs (recovery/settle.py, recovery/runs.py)
    ("final_state", WO),
    ("run_aborted", WO),
    ("run_compensation", WO),
    ("run_settled", WO),
    ("compensation_failed", WO),
    # authority (recovery/proposals.py, migration 0015): approvals and denials of proposals, on the
    # action's chain; revocations of approvals on the chain ``approval:<approval id>``
    ("approval_recorded", OP),
    ("proposal_denied", OP),
    ("approval_revoked", OP),
    # promotions (an approver's re-signed policy) and demotions, on the chain ``authority:<type>``
    ("authority_promoted", OP),
    ("authority_demoted", WO),
    ("authority_policy_changed", WO),
    # the protected evidence store (ledger/vault_store.py, migration 0018): each read, on the action's chain
    ("evidence_read_by_auditor", ("auditor",)),
    # an approver's answer to a server's elicitation (recovery/elicitation_answers.py, migration
    # 0022), on the chain ``elicitation:<id>``; the question and its expiry are the worker's
    ("elicitation_answered", OP),
    # agents' contract reads through the gateway (ledger/reads.py, migration 0023), on the chain
    # ``read:<request id>``: the controller records the request, a worker the answer
    ("read_requested", ("controller",)),
    ("read_answered", W),
    # retention (ledger/retention_ddl.py, migration 0019): written only inside the owner's
    # SECURITY DEFINER functions (a prune, an explicit retention class), by no role directly
    ("ledger_pruned", ()),
    ("retention_set", ()),
)
#: The event rights migration 0018 adds: an auditor's read of the evidence store is the auditor's alone.
EVIDENCE_EVENTS = ("evidence_read_by_auditor",)
#: The event rights migration 0022 adds: an answer to an elicitation is an operator-role write.
ELICITATION_EVENTS = ("elicitation_answered",)
#: The event rights migration 0023 adds: a gateway read's request (controller) and answer (worker).
READ_EVENTS = ("read_requested", "read_answered")
#: The event rights migration 0015 adds to a database migrated before it.
AUTHORITY_EVENTS = ("approval_recorded", "proposal_denied", "approval_revoked", "authority_promoted",
                    "authority_demoted", "authority_policy_changed")
#: Event name prefixes reserved for operators (LIKE patterns).
OPERATOR_EVENT_PREFIXES = ("manual\\_%",)


def _array(values: tuple[str, ...] | None) -> str:
    if values is None:
        return "NULL"
    return "ARRAY[" + ", ".join(f"'{v}'" for v in values) + "]::text[]"


def event_rights_sql(events: tuple[str, ...]) -> str:
    """The insert a migration runs to add the rights of ``events`` (from :data:`EVENT_RIGHTS`)."""
    rights = dict(EVENT_RIGHTS)
    rows = ", ".join(f"('{e}', {_array(rights[e])})" for e in events)
    return f"INSERT INTO ledger_event_rights (event, roles) VALUES {rows} ON CONFLICT DO NOTHING"


def drop_event_rights_sql(events: tuple[str, ...]) -> str:
    return "DELETE FROM ledger_event_rights WHERE event IN (" + ", ".join(f"'{e}'" for e in events) + ")"


def transition_rows(since: str | None = None) -> list[str]:
    """The VALUES rows of the action transitions a migration installs (0003: ``since=None``)."""
    return [
        f"('{t.from_status}', '{t.to_status}', {_array(t.roles)}, {str(t.keeps_outcome).lower()}, "
        f"{_array(t.outcomes)}, {_array(t.from_outcomes)})" for t in ACTION_TRANSITIONS if t.since == since]


def rule_rows_sql() -> str:
    """INSERT statements for the three rule tables (values are constants from this module)."""
    rows = transition_rows()
    idem = [f"('{a}', '{b}')" for a, b in IDEMPOTENCY_TRANSITIONS]
    events = [f"('{e}', {_array(r)})" for e, r in EVENT_RIGHTS]
    return (
        "INSERT INTO action_transitions (from_status, to_status, roles, keeps_outcome, outcomes, from_outcomes) "
        "VALUES\n  " + ",\n  ".join(rows) + ";\n"
        "INSERT INTO idempotency_transitions (from_status, to_status) VALUES " + ", ".join(idem) + ";\n"
        "INSERT INTO ledger_event_rights (event, roles) VALUES " + ", ".join(events) + ";\n"
    )
