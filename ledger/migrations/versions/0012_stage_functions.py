"""Server-side functions for the worker's stages (``ledger/stage_functions.py``): the claim stage in
one statement, and raising variants of the guarded transition and idempotency move, so that a
stage's statements can be pipelined with their COMMIT.

Revision ID: 0012
Revises: 0011
"""

from alembic import op

from ledger.stage_functions import DROP, FUNCTIONS

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(FUNCTIONS)


def downgrade() -> None:
    op.execute(DROP)
