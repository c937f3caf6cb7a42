"""Containment: a delivery count per task message.

``message_deliveries`` counts
deliveries per task message that have not reached a recorded outcome, so a message that kills its
worker is dead-lettered after a bounded number of tries instead of looping.

Revision ID: 0008
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0006"
branch_labels = None
depends_on = None

GRANTS = """
DO $$
DECLARE r text;
BEGIN
  FOREACH r IN ARRAY ARRAY['proofline_runtime', 'proofline_worker', 'proofline_recovery', 'proofline_controller']
  LOOP
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
      EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON message_deliveries TO %I', r);
    END IF;
  END LOOP;
  IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'proofline_reader') THEN
    GRANT SELECT ON message_deliveries TO proofline_reader;
  END IF;
END $$;
"""


def upgrade() -> None:
    op.create_table(
        "message_deliveries",
        sa.Column("message_key", sa.Text, primary_key=True),
        sa.Column("task_name", sa.Text, nullable=False),
        sa.Column("action_id", sa.Text, nullable=True),
        sa.Column("deliveries", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("unsettled", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("first_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("clock_timestamp()")),
        sa.Column("last_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("clock_timestamp()")),
        sa.Column("last_outcome", sa.Text, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("dead_lettered_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("message_deliveries_action_idx", "message_deliveries", ["action_id"])
    op.execute(GRANTS)


def downgrade() -> None:
    op.drop_index("message_deliveries_action_idx", "message_deliveries")
    op.drop_table("message_deliveries")
