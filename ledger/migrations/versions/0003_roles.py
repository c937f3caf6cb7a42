"""Least-privilege database roles: controller, worker, recovery, operator, reader; the rule tables
(legal action and idempotency-record transitions, event rights) and the triggers that enforce them;
proofline_runtime becomes a development role that is worker + recovery.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

from ledger import roles_ddl
from ledger.roles import rule_rows_sql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(roles_ddl.CREATE_ROLES)
    op.execute(roles_ddl.RULE_TABLES)
    op.execute(rule_rows_sql())
    for ddl in (roles_ddl.HELPERS, roles_ddl.ACTION_GUARD, roles_ddl.IDEMPOTENCY_GUARD, roles_ddl.EVENT_GUARD,
                roles_ddl.KILL_SWITCH_GUARD, roles_ddl.CONTAIN_FUNCTION, roles_ddl.TRANSITION_FUNCTION,
                roles_ddl.CHAIN_DEFINER):
        op.execute(ddl)
    database = op.get_bind().execute(sa.text("SELECT current_database()")).scalar_one()
    op.execute(roles_ddl.grants_sql(database))


def downgrade() -> None:
    op.execute(roles_ddl.DOWNGRADE)
    database = op.get_bind().execute(sa.text("SELECT current_database()")).scalar_one()
    # Back to 0002's single runtime role with its table-wide rights.
    from ledger.ddl import RUNTIME_GRANTS

    op.execute(RUNTIME_GRANTS.replace("{database}", database))
