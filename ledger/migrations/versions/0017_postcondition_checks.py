"""Post-condition re-checks: ``postcondition_checks``, one row per re-check a contract asked for.

Written by the worker in the transaction of the verdict that closed an action
``completed_verified`` (``verification.recheck`` in its contract); claimed by the reconciler's sweep
when due (``FOR UPDATE SKIP LOCKED``, a claim that expires) and finished by the re-check task
(``recovery/recheck.py``). ``status`` is text guarded by a CHECK that mirrors
``ledger.states.RecheckStatus`` (``tests/integration/test_ledger.py`` asserts the two sets are
equal). Operational state written next to the ledger: every move has its ledger event.

The worker role (and so recovery and the runtime) inserts and updates rows; every role reads them.

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

#: The statuses as of this migration (a later one that adds a status replaces the CHECK).
STATUSES = ("scheduled", "claimed", "held", "regressed", "unreadable", "cancelled", "expired")
WRITERS = ("proofline_worker",)
READERS = ("proofline_controller", "proofline_operator", "proofline_reader")
GRANTS = """
DO $$
DECLARE r text;
BEGIN
  FOREACH r IN ARRAY ARRAY[{writers}] LOOP
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
      EXECUTE format('GRANT SELECT, INSERT, UPDATE ON postcondition_checks TO %I', r);
      EXECUTE format('GRANT USAGE ON SEQUENCE postcondition_checks_id_seq TO %I', r);
    END IF;
  END LOOP;
  FOREACH r IN ARRAY ARRAY[{readers}] LOOP
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
      EXECUTE format('GRANT SELECT ON postcondition_checks TO %I', r);
    END IF;
  END LOOP;
END $$;
""".format(writers=", ".join(f"'{r}'" for r in WRITERS), readers=", ".join(f"'{r}'" for r in READERS))


def upgrade() -> None:
    now = sa.text("clock_timestamp()")
    op.create_table(
        "postcondition_checks",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("action_id", sa.Text, nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("recheck_key", sa.Text, nullable=False),
        sa.Column("offset_ms", sa.BigInteger, nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("horizon_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default=sa.text("'scheduled'")),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("claim_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finding", sa.Text, nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.UniqueConstraint("action_id", "seq", name="postcondition_checks_once_per_offset"),
        sa.UniqueConstraint("recheck_key", name="postcondition_checks_key_uq"),
        sa.CheckConstraint("status IN (" + ", ".join(f"'{s}'" for s in STATUSES) + ")",
                           name="postcondition_checks_status_known"),
    )
    op.create_index("postcondition_checks_open_idx", "postcondition_checks", ["status", "due_at"])
    op.execute(GRANTS)


def downgrade() -> None:
    op.drop_table("postcondition_checks")
