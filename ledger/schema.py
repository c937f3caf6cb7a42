"""The ledger's tables, declared once in SQLAlchemy Core. Alembic migrations build the same schema
(``tests/integration/test_migrations.py`` compares the two)."""

from __future__ import annotations

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Enum,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import DOUBLE_PRECISION, JSONB

from ledger.states import (
    ActionStatus,
    CaptureKind,
    IdempotencyStatus,
    KillSwitchScope,
    Outcome,
    RecheckStatus,
    RecoveryKind,
    RetentionClass,
    VerificationFinding,
)

metadata = MetaData()


def _enum(py_enum: type, name: str) -> Enum:
    return Enum(py_enum, name=name, values_callable=lambda e: [m.value for m in e], create_type=True)


outcome_type = _enum(Outcome, "outcome_class")
status_type = _enum(ActionStatus, "action_status")
idem_status_type = _enum(IdempotencyStatus, "idempotency_status")
scope_type = _enum(KillSwitchScope, "kill_switch_scope")
recovery_kind_type = _enum(RecoveryKind, "recovery_kind")

NOW = text("clock_timestamp()")
#: The verification findings an action row may hold, as an SQL list.
FINDINGS = ", ".join(f"'{f.value}'" for f in VerificationFinding)
#: The statuses a post-condition re-check may hold, as an SQL list.
RECHECK_STATUSES = ", ".join(f"'{s.value}'" for s in RecheckStatus)
#: The retention classes (text guarded by a CHECK, like findings: a type recreated by a migration
#: round trip would get a new OID and break every cached plan of a connection left open).
RETENTION = ", ".join(f"'{c.value}'" for c in RetentionClass)

ledger_events = Table(
    "ledger_events",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    # The chain key: an action id, or "refused:<digest>" for a refused message.
    Column("action_id", Text, nullable=False),
    # seq, prev_hash and hash are set by the ledger_chain trigger, never by the caller.
    Column("seq", Integer, nullable=False),
    Column("event", Text, nullable=False),
    Column("actor", Text, nullable=False),
    Column("at", DateTime(timezone=True), nullable=False, server_default=NOW),
    Column("evidence", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("prev_hash", Text, nullable=False),
    Column("hash", Text, nullable=False),
    UniqueConstraint("action_id", "seq", name="ledger_events_chain_uq"),
)

actions = Table(
    "actions",
    metadata,
    Column("action_id", Text, primary_key=True),
    Column("run_id", Text, nullable=False),
    Column("step", Integer, nullable=False, server_default=text("0")),
    Column("tenant", Text, nullable=False),
    Column("action_type", Text, nullable=False),
    Column("server", Text, nullable=False),
    Column("tool", Text, nullable=False),
    Column("idempotency_key", Text, nullable=False),
    Column("status", status_type, nullable=False),
    Column("outcome", outcome_type, nullable=True),
    Column("finding", Text, nullable=True),
    Column("reason_code", Text, nullable=True),
    # A redacted copy of the envelope (ledger/redact.py); the signed original is sealed_message.
    Column("envelope", JSONB, nullable=False),
    Column("result", JSONB, nullable=True),
    # What recovery needs later: created ids, prior versions, downstream operation ids.
    Column("recovery_data", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("deadline", DateTime(timezone=True), nullable=False),
    # The head of this action's ledger chain, kept by the chain trigger (detects a removed tail).
    Column("ledger_seq", Integer, nullable=False, server_default=text("0")),
    Column("ledger_head", Text, nullable=False, server_default=text("''")),
    Column("published_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    # "action", or "compensation" of parent_action_id.
    Column("kind", Text, nullable=False, server_default=text("'action'")),
    Column("parent_action_id", Text, nullable=True),
    # The controller's signature, so the reconciler can re-drive the original authority unchanged.
    Column("key_id", Text, nullable=True),
    Column("signature", Text, nullable=True),
    # The signed message as its exact canonical bytes (jsonb would rewrite a NUL; see migration 0008).
    Column("task_id", Text, nullable=True),
    Column("recovery_kind", recovery_kind_type, nullable=True),
    Column("cancel_requested_at", DateTime(timezone=True), nullable=True),
    Column("cancel_requested_by", Text, nullable=True),
    Column("cancel_reason", Text, nullable=True),
    # When the reconciler may next look at this action.
    Column("next_check_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    # The signed message's canonical bytes, AES-256-GCM sealed with the action id as associated
    # data (ledger/seal.py): what the reconciler and recovery send again, byte for byte.
    Column("sealed_message", LargeBinary, nullable=True),
    # An explicit retention class (a legal hold, say: ``proofline ledger hold``); NULL means the
    # class the action's contract names (default ``standard``), resolved when pruning (migration 0019).
    Column("retention_class", Text, nullable=True),
    # Mirrors ledger.states.VerificationFinding (migration 0016).
    CheckConstraint(f"finding IS NULL OR finding IN ({FINDINGS})", name="actions_finding_known"),
    # Mirrors ledger.states.RetentionClass (migration 0019).
    CheckConstraint(f"retention_class IS NULL OR retention_class IN ({RETENTION})", name="actions_retention_known"),
)
Index("actions_status_idx", actions.c.status)
Index("actions_run_idx", actions.c.run_id, actions.c.step)
Index("actions_parent_idx", actions.c.parent_action_id)
Index("actions_next_check_idx", actions.c.status, actions.c.next_check_at)
Index("actions_one_compensation_uq", actions.c.parent_action_id, unique=True,
      postgresql_where=actions.c.kind == "compensation")

idempotency_records = Table(
    "idempotency_records",
    metadata,
    Column("key", Text, primary_key=True),
    Column("action_id", Text, nullable=False),
    Column("tenant", Text, nullable=False),
    Column("argument_hash", Text, nullable=False),
    Column("contract_hash", Text, nullable=False),
    Column("status", idem_status_type, nullable=False),
    Column("fencing_token", BigInteger, nullable=False),
    Column("attempts", Integer, nullable=False, server_default=text("1")),
    Column("result", JSONB, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    Column("expires_at", DateTime(timezone=True), nullable=False),
)

fencing_seq = Sequence("lease_fencing_seq", metadata=metadata)

leases = Table(
    "leases",
    metadata,
    Column("action_id", Text, primary_key=True),
    Column("target_key", Text, nullable=False),
    Column("owner_host", Text, nullable=False),
    Column("owner_pid", Integer, nullable=False),
    Column("worker_id", Text, nullable=False),
    Column("fencing_token", BigInteger, nullable=False),
    Column("acquired_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    Column("heartbeat_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Column("released_at", DateTime(timezone=True), nullable=True),
)

# The reconciler's drain measure reads leases by when they were taken (migration 0024).
Index("leases_acquired_idx", leases.c.acquired_at)

revoked_identities = Table(
    "revoked_identities",
    metadata,
    Column("identity", Text, primary_key=True),
    Column("revoked_by", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("revoked_at", DateTime(timezone=True), nullable=False, server_default=NOW),
)

kill_switches = Table(
    "kill_switches",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("scope", scope_type, nullable=False),
    Column("value", Text, nullable=False, server_default=text("''")),
    Column("set_by", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("set_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    Column("cleared_by", Text, nullable=True),
    Column("cleared_at", DateTime(timezone=True), nullable=True),
)
# At most one active switch per scope and value: "set" twice is a no-op, not two rows to clear.
Index(
    "kill_switches_active_uq",
    kill_switches.c.scope,
    kill_switches.c.value,
    unique=True,
    postgresql_where=kill_switches.c.cleared_at.is_(None),
)

# --- the rules the role guards enforce (ledger/roles.py fills them; ledger/roles_ddl.py reads them) --

action_transitions = Table(
    "action_transitions",
    metadata,
    Column("from_status", status_type, nullable=False),
    Column("to_status", status_type, nullable=False),
    Column("roles", ARRAY(Text), nullable=False),
    Column("keeps_outcome", Boolean, nullable=False),
    Column("outcomes", ARRAY(Text), nullable=False),
    Column("from_outcomes", ARRAY(Text), nullable=True),
    PrimaryKeyConstraint("from_status", "to_status", name="action_transitions_pk"),
)

idempotency_transitions = Table(
    "idempotency_transitions",
    metadata,
    Column("from_status", idem_status_type, nullable=False),
    Column("to_status", idem_status_type, nullable=False),
    PrimaryKeyConstraint("from_status", "to_status", name="idempotency_transitions_pk"),
)

ledger_event_rights = Table(
    "ledger_event_rights",
    metadata,
    Column("event", Text, primary_key=True),
    Column("roles", ARRAY(Text), nullable=False),
)

# Deliveries per task message not yet settled by a recorded outcome (worker/deliveries.py).
message_deliveries = Table(
    "message_deliveries",
    metadata,
    Column("message_key", Text, primary_key=True),
    Column("task_name", Text, nullable=False),
    Column("action_id", Text, nullable=True),
    Column("deliveries", Integer, nullable=False, server_default=text("0")),
    Column("unsettled", Integer, nullable=False, server_default=text("0")),
    # Deliveries whose process was killed from outside, not counted as unsettled (worker/lost_delivery.py).
    Column("excused", Integer, nullable=False, server_default=text("0")),
    Column("first_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    Column("last_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    Column("last_outcome", Text, nullable=True),
    Column("last_error", Text, nullable=True),
    Column("dead_lettered_at", DateTime(timezone=True), nullable=True),
    Column("retention_class", Text, nullable=False, server_default=text("'short'")),
    CheckConstraint(f"retention_class IN ({RETENTION})", name="message_deliveries_retention_known"),
)
Index("message_deliveries_action_idx", message_deliveries.c.action_id)

# The newest send time each consumer took from each queue (worker/queue_marks.py; recovery/backlog.py).
queue_marks = Table(
    "queue_marks",
    metadata,
    Column("queue", Text, primary_key=True),
    Column("consumer", Text, primary_key=True),
    Column("sent_at", DOUBLE_PRECISION, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=NOW),
)

# The reconciler's last sweep per sweeping process (ledger/heartbeat.py; read by proofline doctor).
reconciler_heartbeats = Table(
    "reconciler_heartbeats",
    metadata,
    Column("sweeper", Text, primary_key=True),
    Column("swept_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    Column("counts", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
)

# One row per run of a fleet-wide periodic sweep (recovery/sweep_gate.py): one run per period.
sweep_runs = Table(
    "sweep_runs",
    metadata,
    Column("run_id", BigInteger, primary_key=True, autoincrement=True),
    Column("sweep", Text, nullable=False),
    Column("slot", BigInteger, nullable=False),
    Column("holder", Text, nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    Column("finished_at", DateTime(timezone=True), nullable=True),
    Column("counts", JSONB, nullable=True),
    UniqueConstraint("sweep", "slot", name="sweep_runs_once_per_slot"),
)
Index("sweep_runs_started_idx", sweep_runs.c.started_at)

# Approvals revoked one by one (proofline approvals revoke): an action not yet sent that carries a
# revoked approval is refused (worker/authorize.py). Insert-only; the ledger chain
# ``approval:<id>`` records who and why.
approval_revocations = Table(
    "approval_revocations",
    metadata,
    Column("approval_id", Text, primary_key=True),
    Column("revoked_by", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("revoked_at", DateTime(timezone=True), nullable=False, server_default=NOW),
)

# Approvals of proposals (proofline approve): the approver's signed statement, verified by the
# worker against the keyring on every delivery; a row alone authorizes nothing. Insert-only.
action_approvals = Table(
    "action_approvals",
    metadata,
    Column("approval_id", Text, primary_key=True),
    Column("action_id", Text, nullable=False),
    Column("approver", Text, nullable=False),
    Column("signed", JSONB, nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=NOW),
)
Index("action_approvals_action_idx", action_approvals.c.action_id)

# Automatic demotions of an action type's authority (recovery/authority_watch.py): while the policy
# whose hash a row names is in force, the worker runs that type at ``to_mode`` at most. A newly
# signed policy (a promotion after review) supersedes it. Insert-only.
authority_demotions = Table(
    "authority_demotions",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("action_type", Text, nullable=False),
    Column("policy_hash", Text, nullable=False),
    Column("from_mode", Text, nullable=False),
    Column("to_mode", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("evidence", JSONB, nullable=False),
    Column("demoted_by", Text, nullable=False),
    Column("demoted_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    UniqueConstraint("action_type", "policy_hash", name="authority_demotions_once_per_policy"),
)

#: The capture kinds a row may hold, as an SQL list.
CAPTURE_KINDS = ", ".join(f"'{k.value}'" for k in CaptureKind)

# The protected evidence store (ledger/vault_store.py): raw values a contract's evidence_capture
# policy keeps, sealed to the auditor's X25519 key (proofline/vault.py). Workers insert and cannot
# select; only proofline_auditor reads (migration 0018). The ledger event ``evidence_captured``
# records each row's plaintext digest. Insert-only.
evidence_captures = Table(
    "evidence_captures",
    metadata,
    Column("capture_id", Text, primary_key=True),
    Column("action_id", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("key_id", Text, nullable=False),
    Column("ephemeral_public", LargeBinary, nullable=False),
    Column("nonce", LargeBinary, nullable=False),
    Column("ciphertext", LargeBinary, nullable=False),
    Column("plaintext_sha256", Text, nullable=False),
    Column("retention", Text, nullable=False),
    Column("captured_by", Text, nullable=False),
    Column("captured_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    CheckConstraint(f"kind IN ({CAPTURE_KINDS})", name="evidence_captures_kind_known"),
)
Index("evidence_captures_action_idx", evidence_captures.c.action_id)

# Post-condition re-checks a contract asked for (proofline/recheck.py), written in the transaction
# of the verdict that closed the action ``completed_verified``; the reconciler claims the due ones
# (recovery/recheck_sweep.py) and a worker reads them (recovery/recheck.py). Guarded moves only
# (ledger/rechecks.py); ``attempts`` is the claim's fencing token.
postcondition_checks = Table(
    "postcondition_checks",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("action_id", Text, nullable=False),
    # 1, 2, ... in the order of the contract's offsets.
    Column("seq", Integer, nullable=False),
    # The re-check's own idempotency key (its task carries it; its events name it).
    Column("recheck_key", Text, nullable=False),
    Column("offset_ms", BigInteger, nullable=False),
    Column("due_at", DateTime(timezone=True), nullable=False),
    Column("horizon_at", DateTime(timezone=True), nullable=False),
    Column("status", Text, nullable=False, server_default=text("'scheduled'")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("claim_expires_at", DateTime(timezone=True), nullable=True),
    Column("finding", Text, nullable=True),
    Column("finished_at", DateTime(timezone=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    UniqueConstraint("action_id", "seq", name="postcondition_checks_once_per_offset"),
    UniqueConstraint("recheck_key", name="postcondition_checks_key_uq"),
    # Mirrors ledger.states.RecheckStatus (migration 0017).
    CheckConstraint(f"status IN ({RECHECK_STATUSES})", name="postcondition_checks_status_known"),
)
# What the reconciler's sweep reads: the open rows by due time (an idle sweep reads only this index).
Index("postcondition_checks_open_idx", postcondition_checks.c.status, postcondition_checks.c.due_at)

# The tables ``proofline ledger prune`` removes old rows from, besides whole action chains
# (ledger/retention.py, migration 0019): a row is removed once ``age_column`` is older than the
# duration of its class (``class_column``) and ``condition`` holds. A migration that adds a table
# with a retention class registers it here; nothing else prunes.
retention_tables = Table(
    "retention_tables",
    metadata,
    Column("table_name", Text, primary_key=True),
    Column("age_column", Text, nullable=False),
    Column("class_column", Text, nullable=False),
    Column("condition", Text, nullable=False, server_default=text("'true'")),
)
