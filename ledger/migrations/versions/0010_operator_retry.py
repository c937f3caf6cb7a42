"""Operator retry and lifted revocations.

- ``escalated -> published`` for proofline_operator, only from ``failed_before_side_effect``: an
  escalated action whose effect is proven absent is sent again with the same key
  (``proofline retry``, recovery/operator_retry.py), as recovery's own retry does.
- ``identity_revoked`` and ``revocation_lifted`` are operator events (chain ``revocation:<identity>``).
- proofline_operator may delete a row of ``revoked_identities`` (lifting a revocation); the ledger
  keeps both the revocation and its lifting.

A database migrated from scratch already has these rows (migration 0003 inserts the rules of
ledger/roles.py as they are now), so the inserts skip rows that exist.

Revision ID: 0009
Revises: 0008
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

UPGRADE = """
INSERT INTO action_transitions (from_status, to_status, roles, keeps_outcome, outcomes, from_outcomes)
VALUES ('escalated', 'published', ARRAY['operator']::text[], true, ARRAY[]::text[],
        ARRAY['failed_before_side_effect']::text[])
ON CONFLICT DO NOTHING;
INSERT INTO ledger_event_rights (event, roles) VALUES ('identity_revoked', ARRAY['operator']::text[]),
  ('revocation_lifted', ARRAY['operator']::text[])
ON CONFLICT DO NOTHING;
DO $$ BEGIN
  IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'proofline_operator') THEN
    GRANT DELETE ON revoked_identities TO proofline_operator;
  END IF;
END $$;
"""

DOWNGRADE = """
DELETE FROM action_transitions WHERE from_status = 'escalated' AND to_status = 'published';
DELETE FROM ledger_event_rights WHERE event IN ('identity_revoked', 'revocation_lifted');
DO $$ BEGIN
  IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'proofline_operator') THEN
    REVOKE DELETE ON revoked_identities FROM proofline_operator;
  END IF;
END $$;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
