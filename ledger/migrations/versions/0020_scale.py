"""Kill switches scoped by server, and the worker's count of failed precondition reads.

- Tool switches name a server: ``tool`` switches hold ``SERVER:TOOL``, ``tool_tenant`` ones
  ``SERVER:TOOL@TENANT``. An existing tool-only switch meant that tool on every server, and says so
  now: ``*:TOOL`` (``*:TOOL@TENANT``). Containment (``proofline_contain``) sets the action's own
  server's tool.
- ``actions_guard`` takes ``recovery_data.read_failures`` (worker/read_waits.py) for bookkeeping,
  like the reconciler's redrive count, not for a transition.

Revision ID: 0020
Revises: 0019
"""

from alembic import op

from ledger import roles_ddl

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_SCOPED = "scope IN ('tool', 'tool_tenant') AND position(':' in split_part(value, '@', 1)) = 0"
_OLD_GUARD = ("(NEW.recovery_data - 'redrives') IS DISTINCT FROM (OLD.recovery_data - 'redrives');")
_NEW_GUARD = ("(NEW.recovery_data - 'redrives' - 'read_failures') IS DISTINCT FROM\n"
              "       (OLD.recovery_data - 'redrives' - 'read_failures');")


def _guard() -> str:
    return roles_ddl.ACTION_GUARD.split("CREATE TRIGGER")[0].replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def _contain() -> str:
    return roles_ddl.CONTAIN_FUNCTION.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def upgrade() -> None:
    # A tool-only switch covered the tool on every server: made explicit. The owning role runs
    # this, so the switch guard (which lets only clearing change a row) does not apply.
    op.execute(f"UPDATE kill_switches SET value = '*:' || value WHERE {_SCOPED}")
    op.execute(_guard())
    op.execute(_contain())


def downgrade() -> None:
    # Back to tool-only names: a server-scoped switch widens to every server of that tool name
    # (blocking more, never less); duplicates that creates are cleared, the oldest kept.
    op.execute("""
UPDATE kill_switches k SET cleared_at = clock_timestamp(), cleared_by = 'migration 0020 downgrade'
 WHERE k.cleared_at IS NULL AND k.scope IN ('tool', 'tool_tenant') AND EXISTS (
   SELECT 1 FROM kill_switches o WHERE o.cleared_at IS NULL AND o.scope = k.scope AND o.id < k.id
      AND split_part(o.value, ':', 2) = split_part(k.value, ':', 2))""")
    op.execute("UPDATE kill_switches SET value = split_part(value, ':', 2) "
               "WHERE scope IN ('tool', 'tool_tenant') AND position(':' in value) > 0")
    op.execute(_guard().replace(_NEW_GUARD, _OLD_GUARD))
    op.execute(_contain().replace("v := a.server || ':' || a.tool || '@' || a.tenant;", "v := a.tool || '@' || a.tenant;")
               .replace("SELECT server, tool, tenant, status", "SELECT tool, tenant, status"))
