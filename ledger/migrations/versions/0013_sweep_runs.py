"""Fleet-wide sweeps: one row per run of a periodic sweep (``recovery/sweep_gate.py``).

Every beat of every node sends the reconcile task, so with N nodes N sweeps would arrive each
period. A run claims its period first: ``(sweep, slot)`` is unique, the slot being the database
clock divided by the period, so one run per period commits its claim and the others skip. The row
names who ran it (``holder``: the worker id, which carries the Celery node name) and is stamped
``finished_at`` with the sweep's counts when it ends; a row never finished is a run whose holder
died. Runs older than a day are pruned by the sweep itself. Operational state, not ledger.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

SWEEPERS = ("proofline_runtime", "proofline_recovery")
READERS = ("proofline_worker", "proofline_controller", "proofline_operator", "proofline_reader")
GRANTS = """
DO $$
DECLARE r text;
BEGIN
  FOREACH r IN ARRAY ARRAY[{sweepers}] LOOP
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
      EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON sweep_runs TO %I', r);
      EXECUTE format('GRANT USAGE ON SEQUENCE sweep_runs_run_id_seq TO %I', r);
    END IF;
  END LOOP;
  FOREACH r IN ARRAY ARRAY[{readers}] LOOP
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
      EXECUTE format('GRANT SELECT ON sweep_runs TO %I', r);
    END IF;
  END LOOP;
END $$;
""".format(sweepers=", ".join(f"'{r}'" for r in SWEEPERS), readers=", ".join(f"'{r}'" for r in READERS))


def upgrade() -> None:
    op.create_table(
        "sweep_runs",
        sa.Column("run_id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("sweep", sa.Text, nullable=False),
        sa.Column("slot", sa.BigInteger, nullable=False),
        sa.Column("holder", sa.Text, nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.text("clock_timestamp()")),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("counts", JSONB, nullable=True),
        sa.UniqueConstraint("sweep", "slot", name="sweep_runs_once_per_slot"),
    )
    op.create_index("sweep_runs_started_idx", "sweep_runs", ["started_at"])
    op.execute(GRANTS)


def downgrade() -> None:
    op.drop_table("sweep_runs")
