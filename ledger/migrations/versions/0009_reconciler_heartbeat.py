"""The reconciler's heartbeat: one row per sweeping process, stamped at the end of every sweep.

``proofline doctor`` reads it to tell a deployment whose reconciler (Celery beat plus a worker on
the ``reconcile`` queue) is not running, which would leave lost messages never re-driven. It is
operational state, not ledger: one row per sweeper, overwritten. Every role may also read
``alembic_version`` from now on, so the doctor can compare revisions as any role.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

GRANTS = """
DO $$
DECLARE r text;
BEGIN
  FOREACH r IN ARRAY ARRAY['proofline_runtime', 'proofline_recovery']
  LOOP
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
      EXECUTE format('GRANT SELECT, INSERT, UPDATE ON reconciler_heartbeats TO %I', r);
    END IF;
  END LOOP;
  FOREACH r IN ARRAY ARRAY['proofline_reader', 'proofline_operator', 'proofline_worker', 'proofline_controller']
  LOOP
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
      EXECUTE format('GRANT SELECT ON reconciler_heartbeats TO %I', r);
    END IF;
  END LOOP;
  -- Every role may read which migration the database is at (proofline doctor compares it).
  FOREACH r IN ARRAY ARRAY['proofline_runtime', 'proofline_worker', 'proofline_recovery', 'proofline_controller',
                           'proofline_operator', 'proofline_reader']
  LOOP
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
      EXECUTE format('GRANT SELECT ON alembic_version TO %I', r);
    END IF;
  END LOOP;
END $$;
"""


def upgrade() -> None:
    op.create_table(
        "reconciler_heartbeats",
        sa.Column("sweeper", sa.Text, primary_key=True),
        sa.Column("swept_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("clock_timestamp()")),
        sa.Column("counts", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    )
    op.execute(GRANTS)


def downgrade() -> None:
    op.drop_table("reconciler_heartbeats")
