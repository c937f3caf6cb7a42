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

ALL_ROLES = ("proofline_runtime", "proofline_worker", "proofline_recovery", "proofline_controller",
             "proofline_operator", "proofline_reader")
#: (role, privileges, table): the sweeping roles write the heartbeat, every role reads it and may
#: read which migration the database is at (proofline doctor compares it).
PRIVILEGES = [
    *((role, "SELECT, INSERT, UPDATE" if role in ("proofline_runtime", "proofline_recovery") else "SELECT",
       "reconciler_heartbeats") for role in ALL_ROLES),
    *((role, "SELECT", "alembic_version") for role in ALL_ROLES),
]
GRANTS = """
DO $$
DECLARE g record;
BEGIN
  FOR g IN SELECT * FROM (VALUES {rows}) AS t(role, privileges, target) LOOP
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = g.role) THEN
      EXECUTE format('GRANT %s ON %I TO %I', g.privileges, g.target, g.role);
    END IF;
  END LOOP;
END $$;
""".format(rows=", ".join(f"('{r}', '{p}', '{t}')" for r, p, t in PRIVILEGES))


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
