"""The initial ledger: events, actions, idempotency records, leases, revocations, kill switches.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from ledger.ddl import CHAIN_TRIGGER, HASH_FUNCTION, INSERT_ONLY_TRIGGER, RUNTIME_GRANTS

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

OUTCOMES = (
    "not_started", "accepted", "completed_verified", "completed_unverified", "partially_completed",
    "failed_before_side_effect", "failed_after_side_effect", "unknown_outcome", "compensated",
    "compensation_failed",
)
STATUSES = ("published", "executing", "verifying", "recovery", "escalated", "closed")
IDEM = ("in_progress", "completed", "failed", "unknown")
SCOPES = ("global", "action_type", "tool", "tenant")

NOW = sa.text("clock_timestamp()")


def _ts(name: str, nullable: bool = False, default: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable, server_default=NOW if default else None)


def upgrade() -> None:
    outcome = postgresql.ENUM(*OUTCOMES, name="outcome_class")
    status = postgresql.ENUM(*STATUSES, name="action_status")
    idem = postgresql.ENUM(*IDEM, name="idempotency_status")
    scope = postgresql.ENUM(*SCOPES, name="kill_switch_scope")

    op.create_table(
        "ledger_events",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("action_id", sa.Text, nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("event", sa.Text, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        _ts("at"),
        sa.Column("evidence", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("prev_hash", sa.Text, nullable=False),
        sa.Column("hash", sa.Text, nullable=False),
        sa.UniqueConstraint("action_id", "seq", name="ledger_events_chain_uq"),
    )
    op.create_table(
        "actions",
        sa.Column("action_id", sa.Text, primary_key=True),
        sa.Column("run_id", sa.Text, nullable=False),
        sa.Column("step", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("action_type", sa.Text, nullable=False),
        sa.Column("server", sa.Text, nullable=False),
        sa.Column("tool", sa.Text, nullable=False),
        sa.Column("idempotency_key", sa.Text, nullable=False),
        sa.Column("status", status, nullable=False),
        sa.Column("outcome", outcome, nullable=True),
        sa.Column("finding", sa.Text, nullable=True),
        sa.Column("reason_code", sa.Text, nullable=True),
        sa.Column("envelope", postgresql.JSONB, nullable=False),
        sa.Column("result", postgresql.JSONB, nullable=True),
        sa.Column("recovery_data", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        _ts("deadline", default=False),
        sa.Column("ledger_seq", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("ledger_head", sa.Text, nullable=False, server_default=sa.text("''")),
        _ts("published_at"),
        _ts("updated_at"),
    )
    op.create_index("actions_status_idx", "actions", ["status"])
    op.create_index("actions_run_idx", "actions", ["run_id", "step"])
    op.create_table(
        "idempotency_records",
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("action_id", sa.Text, nullable=False),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("argument_hash", sa.Text, nullable=False),
        sa.Column("contract_hash", sa.Text, nullable=False),
        sa.Column("status", idem, nullable=False),
        sa.Column("fencing_token", sa.BigInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("1")),
        sa.Column("result", postgresql.JSONB, nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        _ts("expires_at", default=False),
    )
    op.execute("CREATE SEQUENCE lease_fencing_seq")
    op.create_table(
        "leases",
        sa.Column("action_id", sa.Text, primary_key=True),
        sa.Column("target_key", sa.Text, nullable=False),
        sa.Column("owner_host", sa.Text, nullable=False),
        sa.Column("owner_pid", sa.Integer, nullable=False),
        sa.Column("worker_id", sa.Text, nullable=False),
        sa.Column("fencing_token", sa.BigInteger, nullable=False),
        _ts("acquired_at"),
        _ts("heartbeat_at"),
        _ts("expires_at", default=False),
        _ts("released_at", nullable=True, default=False),
    )
    op.create_table(
        "revoked_identities",
        sa.Column("identity", sa.Text, primary_key=True),
        sa.Column("revoked_by", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        _ts("revoked_at"),
    )
    op.create_table(
        "kill_switches",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("scope", scope, nullable=False),
        sa.Column("value", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column("set_by", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        _ts("set_at"),
        sa.Column("cleared_by", sa.Text, nullable=True),
        _ts("cleared_at", nullable=True, default=False),
    )
    op.create_index(
        "kill_switches_active_uq", "kill_switches", ["scope", "value"], unique=True,
        postgresql_where=sa.text("cleared_at IS NULL"),
    )
    op.execute(HASH_FUNCTION)
    op.execute(CHAIN_TRIGGER)
    op.execute(INSERT_ONLY_TRIGGER)
    database = op.get_bind().execute(sa.text("SELECT current_database()")).scalar_one()
    op.execute(RUNTIME_GRANTS.replace("{database}", database))


def downgrade() -> None:
    for table in ("kill_switches", "revoked_identities", "leases", "idempotency_records", "actions", "ledger_events"):
        op.drop_table(table)
    op.execute("DROP SEQUENCE lease_fencing_seq")
    for enum in ("kill_switch_scope", "idempotency_status", "action_status", "outcome_class"):
        op.execute(f"DROP TYPE {enum}")
    op.execute("DROP FUNCTION ledger_chain(), ledger_refuse_change(), ledger_event_hash(text, text, integer, text, text, timestamptz, jsonb)")
