"""The reconciler's record of when it last sent an action's message is bookkeeping.

``actions_guard`` takes ``recovery_data.sent_at`` (set by the reconciler's claim, read by
``recovery/backlog.py`` to tell a message behind a backlog from a lost one) like the redrive count:
not a transition.

Revision ID: 0021
Revises: 0020
"""

from alembic import op

from ledger import roles_ddl

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

_OLD_GUARD = ("(NEW.recovery_data - 'redrives' - 'read_failures') IS DISTINCT FROM\n"
              "       (OLD.recovery_data - 'redrives' - 'read_failures');")
_NEW_GUARD = ("(NEW.recovery_data - 'redrives' - 'read_failures' - 'sent_at') IS DISTINCT FROM\n"
              "       (OLD.recovery_data - 'redrives' - 'read_failures' - 'sent_at');")


def _guard() -> str:
    return roles_ddl.ACTION_GUARD.split("CREATE TRIGGER")[0].replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def upgrade() -> None:
    op.execute(_guard())


def downgrade() -> None:
    # Before 0021 a re-drive stamp is a change of recovery data: the stamps go with the guard.
    op.execute("ALTER TABLE actions DISABLE TRIGGER USER")
    op.execute("UPDATE actions SET recovery_data = recovery_data - 'sent_at' WHERE recovery_data ? 'sent_at'")
    op.execute("ALTER TABLE actions ENABLE TRIGGER USER")
    op.execute(_guard().replace(_NEW_GUARD, _OLD_GUARD))
