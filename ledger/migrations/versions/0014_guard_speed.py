"""The guards' role check without the per-write plan of a ``pg_roles`` join
(``ledger/guard_speed.py``).

Revision ID: 0014
Revises: 0013
"""

from alembic import op

from ledger.guard_speed import ACTS_AS, ACTS_AS_BEFORE

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(ACTS_AS)


def downgrade() -> None:
    op.execute(ACTS_AS_BEFORE)
