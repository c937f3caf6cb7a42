"""Authority: the ``proposed`` status and its moves, approvals of proposals, revoked approvals.

- ``action_status`` gains ``proposed`` (a prepared action waiting for an approver); its moves are
  the ``since="0015"`` rules of ledger/roles.py: the worker proposes, an operator-role approval
  sends it again, a denial or expiry closes it as ``not_started``.
- ``action_approvals``: approvers' signed statements for proposals (insert-only; the operator role
  inserts, every role reads). ``approval_revocations``: approvals revoked one by one.
- Event rights: ``approval_recorded``, ``proposal_denied``, ``approval_revoked`` and
  ``authority_promoted`` are the operator's; ``authority_demoted`` the runtime's and the operator's.
- The settled-notification trigger also notifies ``proposed`` (ledger/settled.py).

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

from ledger import settled
from ledger.roles import AUTHORITY_EVENTS, EVENT_RIGHTS, transition_rows

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

ROLES = ("proofline_controller", "proofline_worker", "proofline_recovery", "proofline_operator",
         "proofline_reader", "proofline_runtime")


def _grants() -> str:
    rights = dict(EVENT_RIGHTS)
    events = ", ".join(f"('{e}', ARRAY[{', '.join(repr(r) for r in rights[e])}]::text[])" for e in AUTHORITY_EVENTS)
    return f"""
INSERT INTO action_transitions (from_status, to_status, roles, keeps_outcome, outcomes, from_outcomes)
VALUES {", ".join(transition_rows("0015"))} ON CONFLICT DO NOTHING;
INSERT INTO ledger_event_rights (event, roles) VALUES {events} ON CONFLICT DO NOTHING;
DO $$ BEGIN
  IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'proofline_operator') THEN
    REVOKE ALL ON action_approvals, approval_revocations, authority_demotions FROM {", ".join(ROLES)};
    GRANT SELECT ON action_approvals, approval_revocations, authority_demotions TO {", ".join(ROLES)};
    GRANT INSERT ON action_approvals, approval_revocations TO proofline_operator;
    -- Demotions only lower authority: the runtime (worker, so recovery) records them, operators too.
    GRANT INSERT ON authority_demotions TO proofline_worker, proofline_operator;
    GRANT USAGE ON SEQUENCE authority_demotions_id_seq TO proofline_worker, proofline_operator;
  END IF;
END $$;
"""


def upgrade() -> None:
    # A new enum value must commit before any statement uses it.
    with op.get_context().autocommit_block():
        op.execute("ALTER TYPE action_status ADD VALUE IF NOT EXISTS 'proposed' AFTER 'published'")
    op.create_table(
        "approval_revocations",
        sa.Column("approval_id", sa.Text, primary_key=True),
        sa.Column("revoked_by", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("clock_timestamp()")),
    )
    op.create_table(
        "action_approvals",
        sa.Column("approval_id", sa.Text, primary_key=True),
        sa.Column("action_id", sa.Text, nullable=False),
        sa.Column("approver", sa.Text, nullable=False),
        sa.Column("signed", sa.dialects.postgresql.JSONB, nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("clock_timestamp()")),
    )
    op.create_index("action_approvals_action_idx", "action_approvals", ["action_id"])
    op.create_table(
        "authority_demotions",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("action_type", sa.Text, nullable=False),
        sa.Column("policy_hash", sa.Text, nullable=False),
        sa.Column("from_mode", sa.Text, nullable=False),
        sa.Column("to_mode", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("evidence", sa.dialects.postgresql.JSONB, nullable=False),
        sa.Column("demoted_by", sa.Text, nullable=False),
        sa.Column("demoted_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("clock_timestamp()")),
        sa.UniqueConstraint("action_type", "policy_hash", name="authority_demotions_once_per_policy"),
    )
    op.execute(_grants())
    # A controller waiting on an action is woken when it becomes a proposal too.
    op.execute(settled.DROP)
    op.execute(settled.TRIGGER)


def downgrade() -> None:
    op.execute("DELETE FROM action_transitions WHERE from_status = 'proposed' OR to_status = 'proposed'")
    op.execute("DELETE FROM ledger_event_rights WHERE event IN ("
               + ", ".join(f"'{e}'" for e in AUTHORITY_EVENTS) + ")")
    op.drop_table("authority_demotions")
    op.drop_table("action_approvals")
    op.drop_table("approval_revocations")
    # Postgres cannot drop an enum value; a 'proposed' left unused is harmless.
