"""The protected evidence store: ``evidence_captures`` and the ``proofline_auditor`` role.

- ``evidence_captures``: raw arguments, results and reads a contract's ``evidence_capture`` policy
  keeps, each sealed to the auditor's X25519 key (ciphertext, ephemeral public key, nonce, key id),
  with its retention class and plaintext digest. Insert-only.
- ``proofline_auditor``: the one role that may SELECT it. The worker role may INSERT and not
  SELECT; controller, recovery (beyond the worker's insert), operator, reader and PUBLIC have no
  right on it (ledger/roles_ddl.py ``evidence_store_grants_sql``).
- Event rights: ``evidence_read_by_auditor`` is the auditor's alone.

Revision ID: 0018
Revises: 0017
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from ledger import roles_ddl
from ledger.roles import EVENT_RIGHTS, EVIDENCE_EVENTS

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

#: The capture kinds as of this migration (ledger.states.CaptureKind; a later kind replaces the CHECK).
KINDS = ("arguments", "result", "precondition_read", "verification_read")


def upgrade() -> None:
    op.create_table(
        "evidence_captures",
        sa.Column("capture_id", sa.Text, primary_key=True),
        sa.Column("action_id", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("key_id", sa.Text, nullable=False),
        sa.Column("ephemeral_public", postgresql.BYTEA, nullable=False),
        sa.Column("nonce", postgresql.BYTEA, nullable=False),
        sa.Column("ciphertext", postgresql.BYTEA, nullable=False),
        sa.Column("plaintext_sha256", sa.Text, nullable=False),
        sa.Column("retention", sa.Text, nullable=False),
        sa.Column("captured_by", sa.Text, nullable=False),
        sa.Column("captured_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.text("clock_timestamp()")),
        sa.CheckConstraint("kind IN (" + ", ".join(f"'{k}'" for k in KINDS) + ")",
                           name="evidence_captures_kind_known"),
    )
    op.create_index("evidence_captures_action_idx", "evidence_captures", ["action_id"])
    rights = dict(EVENT_RIGHTS)
    events = ", ".join(f"('{e}', ARRAY[{', '.join(repr(r) for r in rights[e])}]::text[])" for e in EVIDENCE_EVENTS)
    op.execute(f"INSERT INTO ledger_event_rights (event, roles) VALUES {events} ON CONFLICT DO NOTHING")
    op.execute(roles_ddl.CREATE_AUDITOR)
    database = op.get_bind().execute(sa.text("SELECT current_database()")).scalar_one()
    op.execute(roles_ddl.evidence_store_grants_sql(database))


def downgrade() -> None:
    op.execute("DELETE FROM ledger_event_rights WHERE event IN (" + ", ".join(f"'{e}'" for e in EVIDENCE_EVENTS) + ")")
    op.execute(roles_ddl.EVIDENCE_STORE_DOWNGRADE)
    op.drop_table("evidence_captures")
