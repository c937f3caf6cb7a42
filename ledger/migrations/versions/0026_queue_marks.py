"""The newest message each consumer took from each queue.

Where the broker cannot be looked into without taking a message (AMQP), the reconciler tells a
backlog from a loss by what was taken instead: a queue is first in, first out, so every message
sent before the newest one a consumer took from it was taken already (``recovery/backlog.py``).
Each worker's consumer keeps its newest send time per queue here (``worker/queue_marks.py``): one
row per queue and consumer, only ever raised.

Revision ID: 0026
Revises: 0025
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import DOUBLE_PRECISION

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

#: Who raises the marks (the worker's consumer) and reads them (the reconciler); the reader role reads.
WRITERS = ("proofline_runtime", "proofline_worker", "proofline_recovery")
READER = "proofline_reader"


def upgrade() -> None:
    op.create_table(
        "queue_marks",
        sa.Column("queue", sa.Text, primary_key=True),
        sa.Column("consumer", sa.Text, primary_key=True),
        sa.Column("sent_at", DOUBLE_PRECISION, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.text("clock_timestamp()")),
    )
    present = {row[0] for row in op.get_bind().execute(
        sa.text("SELECT rolname FROM pg_roles WHERE rolname = ANY(:roles)"), {"roles": [*WRITERS, READER]})}
    for role in (r for r in WRITERS if r in present):
        op.execute(f"GRANT SELECT, INSERT, UPDATE ON queue_marks TO {role}")
    if READER in present:
        op.execute(f"GRANT SELECT ON queue_marks TO {READER}")


def downgrade() -> None:
    op.drop_table("queue_marks")
