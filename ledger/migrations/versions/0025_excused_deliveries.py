"""Deliveries excused because their pool process was killed from outside.

``message_deliveries.excused`` counts the deliveries of a message whose pool process ended by a
signal sent to it from outside (SIGKILL or SIGTERM, with no out-of-memory kill on the node while
it ran): the message did not end its process, so those deaths are not counted against it by the
message guard (``worker/lost_delivery.py``), up to ``max_excused_deliveries``.

Revision ID: 0025
Revises: 0024
"""

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("message_deliveries", sa.Column("excused", sa.Integer(), nullable=False, server_default=sa.text("0")))


def downgrade() -> None:
    op.drop_column("message_deliveries", "excused")
