"""Independent evidence: ``actions.finding`` holds only known verification findings, and
``evidence_conflict`` is one of them (sources that answered and disagree about an effect).

The column stays text; the ``actions_finding_known`` CHECK mirrors ``ledger.states.VerificationFinding``
(``tests/integration/test_ledger.py`` asserts the two sets are equal).

Revision ID: 0016
Revises: 0015
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

#: The findings as of this migration (a later one that adds a finding replaces the CHECK).
FINDINGS = ("expected", "tolerated", "prohibited", "not_reached", "absent", "unavailable", "evidence_conflict")


def _check(findings: tuple[str, ...]) -> str:
    return "finding IS NULL OR finding IN (" + ", ".join(f"'{f}'" for f in findings) + ")"


def upgrade() -> None:
    op.create_check_constraint("actions_finding_known", "actions", _check(FINDINGS))


def downgrade() -> None:
    op.drop_constraint("actions_finding_known", "actions", type_="check")
