"""Gateway reads: an agent's read request is the controller role's write, its answer the worker's.

The gateway (a controller) records ``read_requested`` on the chain ``read:<request id>``; a worker
that verified the signed ``proofline.read`` task appends ``read_answered`` there
(``ledger/reads.py``). No other role may append either.

Revision ID: 0023
Revises: 0022
"""

from alembic import op

from ledger.roles import READ_EVENTS, drop_event_rights_sql, event_rights_sql

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(event_rights_sql(READ_EVENTS))


def downgrade() -> None:
    op.execute(drop_event_rights_sql(READ_EVENTS))
