"""Elicitations routed to approvers: answering one is the operator role's write.

A worker records a server's question (``elicitation_asked``) and gives up on it
(``elicitation_expired``) on the chain ``elicitation:<id>``, as it records any event; the answer
(``elicitation_answered``, an approver's signed statement, ``recovery/elicitation_answers.py``) may
be appended by the operator role only.

Revision ID: 0022
Revises: 0021
"""

from alembic import op

from ledger.roles import ELICITATION_EVENTS, EVENT_RIGHTS

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    rights = dict(EVENT_RIGHTS)
    rows = ", ".join(f"('{e}', ARRAY[{', '.join(repr(r) for r in rights[e])}]::text[])" for e in ELICITATION_EVENTS)
    op.execute(f"INSERT INTO ledger_event_rights (event, roles) VALUES {rows} ON CONFLICT DO NOTHING")


def downgrade() -> None:
    names = ", ".join(f"'{e}'" for e in ELICITATION_EVENTS)
    op.execute(f"DELETE FROM ledger_event_rights WHERE event IN ({names})")
