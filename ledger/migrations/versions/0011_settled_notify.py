"""Notify on settled actions: ``pg_notify('proofline_action_settled', action_id)`` when an action
moves into closed, cancelled or escalated (``ledger/settled.py``), so a controller waiting on an
action (``proofline/client.py``) wakes when it settles instead of polling.

Revision ID: 0009
Revises: 0008
"""

from alembic import op

from ledger.settled import DROP, TRIGGER

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(TRIGGER)


def downgrade() -> None:
    op.execute(DROP)
