"""Leases by when they were taken, and one lock order for appending to an action's chain.

- ``leases_acquired_idx``: a periodic sweep counts the leases taken over the last half minute or
  so (``recovery/redrive_budget.py``: executions started, how an action leaves ``published``) to
  bound how many lost messages it sends again; the index makes that a range read.
- ``ledger_chain()`` locks the action's row before the chain's append lock
  (``ledger/ddl.py``, ``CHAIN_FUNCTION_ROW_FIRST``): the order a transition already takes them in,
  so a bare append and a transition on one action no longer deadlock.

Revision ID: 0024
Revises: 0023
"""

from alembic import op

from ledger.ddl import CHAIN_FUNCTION_0001, CHAIN_FUNCTION_ROW_FIRST
from ledger.roles_ddl import CHAIN_DEFINER

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("leases_acquired_idx", "leases", ["acquired_at"])
    # CREATE OR REPLACE resets SECURITY and SET to what it states: the owner's rights go back on.
    op.execute(CHAIN_FUNCTION_ROW_FIRST)
    op.execute(CHAIN_DEFINER)


def downgrade() -> None:
    op.execute(CHAIN_FUNCTION_0001)
    op.execute(CHAIN_DEFINER)
    op.drop_index("leases_acquired_idx", table_name="leases")
