"""Secrets: the signed message is stored sealed (AES-256-GCM) in its own bytea column, next to a
redacted ``actions.envelope``.

Rows written before this revision keep their envelope as it was and have no sealed message: a
migration holds no key to seal with, and re-driving them still works from ``envelope``,
``key_id`` and ``signature`` only until they settle (see docs/concepts/secrets.md).

Revision ID: 0006
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("actions", sa.Column("sealed_message", sa.LargeBinary, nullable=True))


def downgrade() -> None:
    op.drop_column("actions", "sealed_message")
