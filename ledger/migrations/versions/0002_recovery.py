"""Recovery: stored signed authority for re-drives, cancellation, compensation links, reconciler
scheduling, pending and cancelled statuses, recovery kinds.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

RECOVERY_KINDS = ("retry", "native_rollback", "compensation", "forward_recovery", "containment",
                  "manual_intervention")


def upgrade() -> None:
    # New enum values must commit before any statement uses them.
    with op.get_context().autocommit_block():
        op.execute("ALTER TYPE action_status ADD VALUE IF NOT EXISTS 'pending' BEFORE 'published'")
        op.execute("ALTER TYPE action_status ADD VALUE IF NOT EXISTS 'cancelled'")
        op.execute("ALTER TYPE kill_switch_scope ADD VALUE IF NOT EXISTS 'tool_tenant'")
    kinds = postgresql.ENUM(*RECOVERY_KINDS, name="recovery_kind")
    kinds.create(op.get_bind())
    op.add_column("actions", sa.Column("kind", sa.Text, nullable=False, server_default=sa.text("'action'")))
    op.add_column("actions", sa.Column("parent_action_id", sa.Text, nullable=True))
    op.add_column("actions", sa.Column("key_id", sa.Text, nullable=True))
    op.add_column("actions", sa.Column("signature", sa.Text, nullable=True))
    op.add_column("actions", sa.Column("task_id", sa.Text, nullable=True))
    op.add_column("actions", sa.Column("recovery_kind", postgresql.ENUM(*RECOVERY_KINDS, name="recovery_kind",
                                                                        create_type=False), nullable=True))
    op.add_column("actions", sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("actions", sa.Column("cancel_requested_by", sa.Text, nullable=True))
    op.add_column("actions", sa.Column("cancel_reason", sa.Text, nullable=True))
    op.add_column("actions", sa.Column("next_check_at", sa.DateTime(timezone=True), nullable=False,
                                       server_default=sa.text("clock_timestamp()")))
    op.create_index("actions_parent_idx", "actions", ["parent_action_id"])
    op.create_index("actions_next_check_idx", "actions", ["status", "next_check_at"])
    # One compensation per original action, at most: a second one would be a second undo.
    op.create_index("actions_one_compensation_uq", "actions", ["parent_action_id"], unique=True,
                    postgresql_where=sa.text("kind = 'compensation'"))


def downgrade() -> None:
    op.drop_index("actions_one_compensation_uq", "actions")
    op.drop_index("actions_next_check_idx", "actions")
    op.drop_index("actions_parent_idx", "actions")
    for column in ("next_check_at", "cancel_reason", "cancel_requested_by", "cancel_requested_at", "recovery_kind",
                   "task_id", "signature", "key_id", "parent_action_id", "kind"):
        op.drop_column("actions", column)
    op.execute("DROP TYPE recovery_kind")
