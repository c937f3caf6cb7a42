"""Retention: classes on settled actions and delivery records, and pruning as its own privilege.

- ``actions.retention_class`` (NULL: the contract's class) and ``message_deliveries.retention_class``
  (default ``short``): text, each guarded by a CHECK mirroring ``ledger.states.RetentionClass``
  (not an ENUM: a type dropped and re-created by a downgrade and upgrade gets a new OID, and an
  open connection's cached plans over ``actions`` would fail).
- ``retention_tables``: the tables pruned by age and class besides whole chains (a later table
  with a retention class registers itself with one row).
- ``proofline_prune()`` and ``proofline_set_retention()`` (SECURITY DEFINER), the role
  ``proofline_pruner`` that may run the first, the insert-only trigger's one exemption, and the
  event rights of ``ledger_pruned`` and ``retention_set`` (nobody's but those functions').

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

from ledger import retention_ddl
from ledger.states import RetentionClass

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

#: The classes as of this migration (a later one that adds a class replaces the CHECKs).
CLASSES = ", ".join(f"'{c.value}'" for c in RetentionClass)


def upgrade() -> None:
    op.add_column("actions", sa.Column("retention_class", sa.Text, nullable=True))
    op.create_check_constraint("actions_retention_known", "actions",
                               f"retention_class IS NULL OR retention_class IN ({CLASSES})")
    op.add_column("message_deliveries", sa.Column("retention_class", sa.Text, nullable=False,
                                                  server_default=sa.text("'short'")))
    op.create_check_constraint("message_deliveries_retention_known", "message_deliveries",
                               f"retention_class IN ({CLASSES})")
    op.create_table(
        "retention_tables",
        sa.Column("table_name", sa.Text, primary_key=True),
        sa.Column("age_column", sa.Text, nullable=False),
        sa.Column("class_column", sa.Text, nullable=False),
        sa.Column("condition", sa.Text, nullable=False, server_default=sa.text("'true'")),
    )
    op.execute(retention_ddl.REFUSE_CHANGE)
    op.execute(retention_ddl.PRUNE_FUNCTION)
    op.execute(retention_ddl.HOLD_FUNCTION)
    op.execute(retention_ddl.GRANTS)


def downgrade() -> None:
    op.execute(retention_ddl.DOWNGRADE)
    op.execute(retention_ddl.REFUSE_CHANGE_BEFORE)
    op.drop_table("retention_tables")
    op.drop_column("message_deliveries", "retention_class")
    op.drop_column("actions", "retention_class")
