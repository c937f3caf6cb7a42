"""The SQL of migration 0014: the role check the guard triggers run on every write, made cheap.

``proofline_acts_as`` used to join the role names with the ``pg_roles`` view (``pg_authid`` joined
with ``pg_db_role_setting``). Inlined into the guards' queries, that join was planned again on
every guarded write: about 0.2 ms of Postgres time per action transition, measured on a 2-core
machine, more than the rest of the transition with its three ledger events. The new body looks
each name up with ``to_regrole`` (a catalog cache lookup; an unknown name, such as the pseudo-role
``recovery_derived``, gives NULL and so no membership) and asks ``pg_has_role`` as before. Same
answers for every input, same SECURITY INVOKER, still inlined (no SET clause, catalog names
qualified).
"""

from __future__ import annotations

ACTS_AS = r"""
CREATE OR REPLACE FUNCTION proofline_acts_as(p_roles text[]) RETURNS boolean
LANGUAGE sql STABLE AS $$
  SELECT EXISTS (SELECT 1 FROM pg_catalog.unnest(p_roles) r
                  WHERE pg_catalog.pg_has_role(current_user, pg_catalog.to_regrole('proofline_' || r), 'USAGE'))
$$;
"""

ACTS_AS_BEFORE = r"""
CREATE OR REPLACE FUNCTION proofline_acts_as(p_roles text[]) RETURNS boolean
LANGUAGE sql STABLE AS $$
  SELECT EXISTS (SELECT 1 FROM pg_catalog.unnest(p_roles) r
                   JOIN pg_catalog.pg_roles g ON g.rolname = 'proofline_' || r
                  WHERE pg_catalog.pg_has_role(current_user, g.oid, 'USAGE'))
$$;
"""
