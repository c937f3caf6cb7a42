"""Database objects SQLAlchemy Core does not declare: the ledger's chain and insert-only triggers,
and the runtime role's original privileges (migration 0003 replaces them with the roles of
``ledger/roles_ddl.py``). Migrations execute these strings."""

from __future__ import annotations

RUNTIME_ROLE = "proofline_runtime"

# The hash covers every column a reader relies on, and the previous event's hash. The same
# function recomputes hashes when a chain is verified, so writer and verifier cannot disagree.
HASH_FUNCTION = r"""
CREATE OR REPLACE FUNCTION ledger_event_hash(
    p_prev text, p_action text, p_seq integer, p_event text, p_actor text,
    p_at timestamptz, p_evidence jsonb) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
  -- A JSON array is an unambiguous encoding: no text can move between fields unnoticed.
  SELECT encode(sha256(convert_to(jsonb_build_array(p_prev, p_action, p_seq, p_event, p_actor,
      to_char(p_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'), p_evidence)::text, 'UTF8')), 'hex')
$$;
"""

CHAIN_TRIGGER = r"""
CREATE OR REPLACE FUNCTION ledger_chain() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
  last record;
BEGIN
  -- Appends to one chain are serialised (until commit), so two writers never both take seq n.
  PERFORM pg_advisory_xact_lock(hashtextextended('proofline:ledger:' || NEW.action_id, 0));
  SELECT seq, hash INTO last FROM ledger_events
   WHERE action_id = NEW.action_id ORDER BY seq DESC LIMIT 1;
  NEW.seq := COALESCE(last.seq, 0) + 1;
  NEW.prev_hash := COALESCE(last.hash, '');
  NEW.at := clock_timestamp();
  NEW.hash := ledger_event_hash(NEW.prev_hash, NEW.action_id, NEW.seq, NEW.event, NEW.actor,
                                NEW.at, NEW.evidence);
  -- Anchor the chain's head outside the chain, so removing its last events is detectable too.
  UPDATE actions SET ledger_seq = NEW.seq, ledger_head = NEW.hash WHERE action_id = NEW.action_id;
  RETURN NEW;
END $$;

CREATE TRIGGER ledger_events_chain BEFORE INSERT ON ledger_events
  FOR EACH ROW EXECUTE FUNCTION ledger_chain();
"""

#: The chain function as migration 0001 created it (what 0024's downgrade puts back).
CHAIN_FUNCTION_0001 = CHAIN_TRIGGER.split("CREATE TRIGGER")[0]
#: The chain function since migration 0024: an action's row is locked before the chain's append
#: lock, so every writer takes the two in one order. Before, the trigger took the append lock and
#: then updated the row, while a transition (or a claim's ``FOR UPDATE``) held the row and then
#: appended: a duplicate delivery recording ``redelivery_ignored`` while the holder moved the
#: action on, or a worker's event while the reconciler held the rows it was re-driving, waited on
#: each other (``DeadlockDetected``: a cycle of the kind the 10,000-item soak logged 180 times). A chain not an
#: action's (``refused:``, ``elicitation:``, ``read:``) has no row, and takes the append lock alone.
_ROW_FIRST = ("BEGIN\n"
              "  -- The action's row first (what a transition holds before it appends), then the chain.\n"
              "  PERFORM 1 FROM actions WHERE action_id = NEW.action_id FOR NO KEY UPDATE;\n")
CHAIN_FUNCTION_ROW_FIRST = CHAIN_FUNCTION_0001.replace("BEGIN\n", _ROW_FIRST, 1)
assert CHAIN_FUNCTION_ROW_FIRST != CHAIN_FUNCTION_0001

INSERT_ONLY_TRIGGER = r"""
CREATE OR REPLACE FUNCTION ledger_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'ledger_events is insert-only (% refused)', TG_OP
    USING ERRCODE = 'insufficient_privilege';
END $$;

CREATE TRIGGER ledger_events_no_update BEFORE UPDATE OR DELETE ON ledger_events
  FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change();
CREATE TRIGGER ledger_events_no_truncate BEFORE TRUNCATE ON ledger_events
  FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
"""

RUNTIME_GRANTS = rf"""
DO $$ BEGIN
  CREATE ROLE {RUNTIME_ROLE} LOGIN;
EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
END $$;
GRANT CONNECT ON DATABASE "{{database}}" TO {RUNTIME_ROLE};
GRANT USAGE ON SCHEMA public TO {RUNTIME_ROLE};
GRANT SELECT, INSERT ON ledger_events TO {RUNTIME_ROLE};
GRANT USAGE ON SEQUENCE ledger_events_id_seq TO {RUNTIME_ROLE};
GRANT SELECT, INSERT, UPDATE ON actions, idempotency_records, leases TO {RUNTIME_ROLE};
GRANT SELECT, INSERT, UPDATE ON revoked_identities, kill_switches TO {RUNTIME_ROLE};
GRANT USAGE ON SEQUENCE lease_fencing_seq, kill_switches_id_seq TO {RUNTIME_ROLE};
GRANT EXECUTE ON FUNCTION ledger_event_hash(text, text, integer, text, text, timestamptz, jsonb) TO {RUNTIME_ROLE};
"""
