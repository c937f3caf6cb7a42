"""The SQL of migration 0003: the five roles, their grants, the rule tables and the guard triggers.

Enforcement is in Postgres. Column privileges keep a role off columns it never writes (envelope,
signature, tenant, ledger head, ...). Row triggers check what a privilege cannot express: which
status moves are legal and for whom, which events a role may append, what a new row may hold.
The triggers run as the caller (``current_user``), so they know who is writing; the few functions
that must write on a role's behalf are ``SECURITY DEFINER``, owned by the migrating role, with a
fixed ``search_path``. Anything the owning role does (migrations, those functions) passes.

Refusals raise SQLSTATE ``PL001`` (illegal action transition), ``PL002`` (illegal idempotency
record change), ``PL003`` (event not allowed for this role), ``PL004`` (row not allowed for this
role) or ``PL005`` (immutable column changed), each with a message naming the rule.
"""

from __future__ import annotations

from ledger.roles import AUDITOR, CONTROLLER, OPERATOR, RECOVERY, ROLES, RUNTIME, WORKER

TABLES = ("ledger_events", "actions", "idempotency_records", "leases", "revoked_identities", "kill_switches",
          "action_transitions", "idempotency_transitions", "ledger_event_rights")

CREATE_ROLES = "\n".join(
    f"""DO $$ BEGIN CREATE ROLE {role} LOGIN;
EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$;""" for role in ROLES) + f"""
-- Roles are cluster-wide: created once, reused by every Proofline database on the server.
GRANT {WORKER} TO {RECOVERY};
GRANT {WORKER}, {RECOVERY} TO {RUNTIME};
"""

RULE_TABLES = """
CREATE TABLE action_transitions (
    from_status action_status NOT NULL,
    to_status action_status NOT NULL,
    roles text[] NOT NULL,
    keeps_outcome boolean NOT NULL,
    outcomes text[] NOT NULL,
    from_outcomes text[],
    CONSTRAINT action_transitions_pk PRIMARY KEY (from_status, to_status)
);
CREATE TABLE idempotency_transitions (
    from_status idempotency_status NOT NULL,
    to_status idempotency_status NOT NULL,
    CONSTRAINT idempotency_transitions_pk PRIMARY KEY (from_status, to_status)
);
CREATE TABLE ledger_event_rights (
    event text PRIMARY KEY,
    roles text[] NOT NULL
);
"""

HELPERS = r"""
-- True for the owning role (and superusers): migrations and the SECURITY DEFINER functions.
-- Catalog names are qualified (no SET clause), so the planner inlines these into the guards.
CREATE FUNCTION proofline_trusted() RETURNS boolean
LANGUAGE sql STABLE AS $$
  SELECT pg_catalog.pg_has_role(current_user, (SELECT c.relowner FROM pg_catalog.pg_class c
                                                WHERE c.oid = 'public.actions'::pg_catalog.regclass), 'USAGE')
$$;

-- Does the writing role hold one of these roles (names without the proofline_ prefix)?
CREATE FUNCTION proofline_acts_as(p_roles text[]) RETURNS boolean
LANGUAGE sql STABLE AS $$
  SELECT EXISTS (SELECT 1 FROM pg_catalog.unnest(p_roles) r
                   JOIN pg_catalog.pg_roles g ON g.rolname = 'proofline_' || r
                  WHERE pg_catalog.pg_has_role(current_user, g.oid, 'USAGE'))
$$;
"""

ACTION_GUARD = r"""
CREATE FUNCTION actions_guard() RETURNS trigger
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
DECLARE
  moved boolean;
  cancelling boolean := false;
BEGIN
  IF proofline_trusted() THEN
    RETURN NEW;
  END IF;
  IF TG_OP = 'INSERT' THEN
    -- A new action starts unexecuted, with an empty chain head. (Its columns are not compared with
    -- its envelope: the stored envelope is a redacted copy, whose values redaction may replace.)
    IF NEW.status NOT IN ('published', 'pending') OR NEW.outcome IS NOT NULL OR NEW.finding IS NOT NULL
       OR NEW.reason_code IS NOT NULL OR NEW.result IS NOT NULL OR NEW.recovery_kind IS NOT NULL
       OR NEW.recovery_data <> '{}'::jsonb OR NEW.ledger_seq <> 0 OR NEW.ledger_head <> ''
       OR NEW.cancel_requested_at IS NOT NULL OR NEW.cancel_requested_by IS NOT NULL
       OR NEW.cancel_reason IS NOT NULL THEN
      RAISE EXCEPTION 'action % refused: a new action is published or pending, with no outcome, result, '
        'cancellation or chain head', NEW.action_id USING ERRCODE = 'PL004';
    END IF;
    IF NEW.kind = 'action' THEN
      IF NOT proofline_acts_as(ARRAY['controller']) OR NEW.parent_action_id IS NOT NULL THEN
        RAISE EXCEPTION 'action % refused: only proofline_controller publishes actions (role %)',
          NEW.action_id, current_user USING ERRCODE = 'PL004';
      END IF;
    ELSIF NOT proofline_acts_as(ARRAY['recovery']) OR NEW.kind NOT IN ('compensation', 'rollback', 'forward')
          OR NEW.status <> 'published'
          OR NOT EXISTS (SELECT 1 FROM actions p WHERE p.action_id = NEW.parent_action_id
                                                   AND p.status = 'recovery') THEN
      RAISE EXCEPTION 'action % refused: only proofline_recovery publishes a % action, for a parent in '
        'recovery (role %)', NEW.action_id, NEW.kind, current_user USING ERRCODE = 'PL004';
    END IF;
    NEW.published_at := clock_timestamp();
    NEW.updated_at := NEW.published_at;
    NEW.next_check_at := NEW.published_at;
    RETURN NEW;
  END IF;

  -- UPDATE. Column privileges already refuse these; the check stays if a grant is ever widened.
  IF (NEW.action_id, NEW.run_id, NEW.step, NEW.tenant, NEW.action_type, NEW.server, NEW.tool,
      NEW.idempotency_key, NEW.envelope, NEW.deadline, NEW.ledger_seq, NEW.ledger_head, NEW.published_at,
      NEW.kind, NEW.parent_action_id, NEW.key_id, NEW.signature, NEW.task_id)
     IS DISTINCT FROM
     (OLD.action_id, OLD.run_id, OLD.step, OLD.tenant, OLD.action_type, OLD.server, OLD.tool,
      OLD.idempotency_key, OLD.envelope, OLD.deadline, OLD.ledger_seq, OLD.ledger_head, OLD.published_at,
      OLD.kind, OLD.parent_action_id, OLD.key_id, OLD.signature, OLD.task_id) THEN
    RAISE EXCEPTION 'action %: immutable column changed (role %)', OLD.action_id, current_user
      USING ERRCODE = 'PL005';
  END IF;
  IF (NEW.cancel_requested_at, NEW.cancel_requested_by, NEW.cancel_reason)
     IS DISTINCT FROM (OLD.cancel_requested_at, OLD.cancel_requested_by, OLD.cancel_reason) THEN
    IF OLD.cancel_requested_at IS NOT NULL OR NEW.cancel_requested_at IS NULL
       OR NOT proofline_acts_as(ARRAY['operator']) THEN
      RAISE EXCEPTION 'action %: a cancellation is requested once, by an operator (role %)', OLD.action_id,
        current_user USING ERRCODE = 'PL005';
    END IF;
    NEW.cancel_requested_at := clock_timestamp();
    cancelling := true;
  END IF;
  -- Bookkeeping is not a transition: the reconciler's (next check, redrive count, when it last
  -- sent the message) and the worker's count of failed precondition reads (worker/read_waits.py).
  moved := NEW.status IS DISTINCT FROM OLD.status OR NEW.outcome IS DISTINCT FROM OLD.outcome
    OR NEW.finding IS DISTINCT FROM OLD.finding OR NEW.reason_code IS DISTINCT FROM OLD.reason_code
    OR NEW.result IS DISTINCT FROM OLD.result OR NEW.recovery_kind IS DISTINCT FROM OLD.recovery_kind
    OR (NEW.recovery_data - 'redrives' - 'read_failures' - 'sent_at') IS DISTINCT FROM
       (OLD.recovery_data - 'redrives' - 'read_failures' - 'sent_at');
  IF moved THEN
    IF NOT EXISTS (
        SELECT 1 FROM action_transitions t
         WHERE t.from_status = OLD.status AND t.to_status = NEW.status
           AND (t.from_outcomes IS NULL OR OLD.outcome::text = ANY (t.from_outcomes))
           AND (NEW.outcome::text = ANY (t.outcomes)
                OR (t.keeps_outcome AND NEW.outcome IS NOT DISTINCT FROM OLD.outcome))
           AND proofline_acts_as(t.roles)) THEN
      RAISE EXCEPTION 'illegal action transition for %: % -> % (outcome % -> %) by role %', OLD.action_id,
        OLD.status, NEW.status, COALESCE(OLD.outcome::text, 'none'), COALESCE(NEW.outcome::text, 'none'),
        current_user USING ERRCODE = 'PL001';
    END IF;
  END IF;
  IF moved OR cancelling THEN
    NEW.updated_at := clock_timestamp();
  ELSE
    NEW.updated_at := OLD.updated_at;
  END IF;
  -- Pushing the next check far away would hide an action from the reconciler.
  IF NEW.next_check_at > clock_timestamp() + interval '1 day' THEN
    RAISE EXCEPTION 'action %: next_check_at more than a day ahead', OLD.action_id USING ERRCODE = 'PL005';
  END IF;
  RETURN NEW;
END $$;

CREATE TRIGGER actions_guard BEFORE INSERT OR UPDATE ON actions
  FOR EACH ROW EXECUTE FUNCTION actions_guard();
"""

IDEMPOTENCY_GUARD = r"""
CREATE FUNCTION idempotency_guard() RETURNS trigger
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
BEGIN
  IF proofline_trusted() THEN
    RETURN NEW;
  END IF;
  IF TG_OP = 'INSERT' THEN
    -- A claim starts in progress, for the published action that holds this very key.
    IF NEW.status <> 'in_progress' OR NEW.attempts <> 1 OR NEW.result IS NOT NULL THEN
      RAISE EXCEPTION 'idempotency record % refused: a claim starts in_progress, attempt 1, no result', NEW.key
        USING ERRCODE = 'PL002';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM actions a WHERE a.action_id = NEW.action_id AND a.idempotency_key = NEW.key
                      AND a.tenant = NEW.tenant AND a.status IN ('published', 'executing')) THEN
      RAISE EXCEPTION 'idempotency record % refused: no published action % holds this key', NEW.key,
        NEW.action_id USING ERRCODE = 'PL002';
    END IF;
    NEW.created_at := clock_timestamp();
    NEW.updated_at := NEW.created_at;
    RETURN NEW;
  END IF;
  IF (NEW.key, NEW.action_id, NEW.tenant, NEW.argument_hash, NEW.contract_hash, NEW.created_at, NEW.expires_at)
     IS DISTINCT FROM
     (OLD.key, OLD.action_id, OLD.tenant, OLD.argument_hash, OLD.contract_hash, OLD.created_at, OLD.expires_at)
  THEN
    RAISE EXCEPTION 'idempotency record %: immutable column changed', OLD.key USING ERRCODE = 'PL005';
  END IF;
  IF NEW.fencing_token < OLD.fencing_token OR NEW.attempts NOT IN (OLD.attempts, OLD.attempts + 1) THEN
    RAISE EXCEPTION 'idempotency record %: fencing tokens only grow, attempts by one at most', OLD.key
      USING ERRCODE = 'PL002';
  END IF;
  IF NOT EXISTS (SELECT 1 FROM idempotency_transitions t
                  WHERE t.from_status = OLD.status AND t.to_status = NEW.status) THEN
    RAISE EXCEPTION 'illegal idempotency transition for %: % -> % by role %', OLD.key, OLD.status, NEW.status,
      current_user USING ERRCODE = 'PL002';
  END IF;
  NEW.updated_at := clock_timestamp();
  RETURN NEW;
END $$;

CREATE TRIGGER idempotency_guard BEFORE INSERT OR UPDATE ON idempotency_records
  FOR EACH ROW EXECUTE FUNCTION idempotency_guard();
"""

# Named so that it fires before ledger_events_chain (same timing: alphabetical order).
EVENT_GUARD = r"""
CREATE FUNCTION ledger_event_guard() RETURNS trigger
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
DECLARE
  allowed text[];
BEGIN
  IF proofline_trusted() THEN
    RETURN NEW;
  END IF;
  IF NEW.action_id LIKE 'killswitch:%' THEN
    allowed := ARRAY['operator'];
  ELSE
    SELECT roles INTO allowed FROM ledger_event_rights WHERE event = NEW.event;
    IF NOT FOUND THEN
      allowed := CASE WHEN NEW.event LIKE 'manual\_%' THEN ARRAY['operator'] ELSE ARRAY['worker'] END;
    END IF;
  END IF;
  IF proofline_acts_as(allowed) THEN
    RETURN NEW;
  END IF;
  IF 'recovery_derived' = ANY (allowed) AND proofline_acts_as(ARRAY['recovery'])
     AND EXISTS (SELECT 1 FROM actions a WHERE a.action_id = NEW.action_id AND a.kind <> 'action') THEN
    RETURN NEW;
  END IF;
  RAISE EXCEPTION 'event % on % is not allowed for role % (allowed: %)', NEW.event, NEW.action_id,
    current_user, array_to_string(allowed, ', ') USING ERRCODE = 'PL003';
END $$;

CREATE TRIGGER ledger_events_authorize BEFORE INSERT ON ledger_events
  FOR EACH ROW EXECUTE FUNCTION ledger_event_guard();
"""

KILL_SWITCH_GUARD = r"""
CREATE FUNCTION kill_switch_guard() RETURNS trigger
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
BEGIN
  IF proofline_trusted() THEN
    RETURN NEW;
  END IF;
  IF TG_OP = 'INSERT' THEN
    IF NEW.cleared_at IS NOT NULL OR NEW.cleared_by IS NOT NULL THEN
      RAISE EXCEPTION 'a kill switch is set uncleared' USING ERRCODE = 'PL004';
    END IF;
    NEW.set_at := clock_timestamp();
    RETURN NEW;
  END IF;
  -- Clearing is final: a cleared switch is never re-armed or re-dated (set a new one instead).
  IF OLD.cleared_at IS NOT NULL OR NEW.cleared_at IS NULL OR NEW.cleared_by IS NULL THEN
    RAISE EXCEPTION 'kill switch %: only an active switch is cleared, once', OLD.id USING ERRCODE = 'PL005';
  END IF;
  NEW.cleared_at := clock_timestamp();
  RETURN NEW;
END $$;

CREATE TRIGGER kill_switch_guard BEFORE INSERT OR UPDATE ON kill_switches
  FOR EACH ROW EXECUTE FUNCTION kill_switch_guard();
"""

# Containment on a role's behalf: a tool@tenant switch for an action in recovery, derived from the
# action row (the caller cannot choose scope or value), recorded in the switch's own chain.
CONTAIN_FUNCTION = r"""
CREATE FUNCTION proofline_contain(p_action_id text, p_by text, p_reason text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
  a record;
  v text;
  engaged boolean;
BEGIN
  SELECT server, tool, tenant, status INTO a FROM actions WHERE action_id = p_action_id;
  IF NOT FOUND OR a.status <> 'recovery' THEN
    RAISE EXCEPTION 'containment refused: action % is not in recovery', p_action_id USING ERRCODE = 'PL004';
  END IF;
  -- Scoped by server (migration 0020): another server's tool of the same name keeps running.
  v := a.server || ':' || a.tool || '@' || a.tenant;
  INSERT INTO kill_switches (scope, value, set_by, reason) VALUES ('tool_tenant', v, p_by, p_reason)
    ON CONFLICT (scope, value) WHERE cleared_at IS NULL DO NOTHING RETURNING true INTO engaged;
  IF engaged THEN
    INSERT INTO ledger_events (action_id, event, actor, evidence)
    VALUES ('killswitch:tool_tenant:' || v, 'kill_switch_set', p_by,
            jsonb_build_object('scope', 'tool_tenant', 'value', v, 'reason', p_reason));
  END IF;
  RETURN COALESCE(engaged, false);
END $$;
"""

# A guarded transition and its ledger events in one round trip. SECURITY INVOKER on purpose: the
# guards see the caller's role, exactly as for the separate statements it replaces. The events are
# appended only when the row moved (the caller's transaction rolls back on a refusal anyway).
TRANSITION_FUNCTION = r"""
CREATE FUNCTION proofline_transition(
    p_action_id text, p_allowed action_status[], p_status action_status, p_outcome outcome_class,
    p_finding text, p_reason text, p_result jsonb, p_recovery jsonb, p_kind recovery_kind,
    p_actor text, p_events jsonb) RETURNS SETOF actions
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
BEGIN
  UPDATE actions SET status = p_status, outcome = COALESCE(p_outcome, outcome),
         finding = COALESCE(p_finding, finding), reason_code = COALESCE(p_reason, reason_code),
         result = COALESCE(p_result, result), recovery_data = recovery_data || p_recovery,
         recovery_kind = COALESCE(p_kind, recovery_kind), updated_at = clock_timestamp()
   WHERE action_id = p_action_id AND status = ANY (p_allowed);
  IF NOT FOUND THEN
    RETURN;
  END IF;
  INSERT INTO ledger_events (action_id, event, actor, evidence)
  SELECT p_action_id, e.value->>0, p_actor, e.value->1
    FROM jsonb_array_elements(p_events) WITH ORDINALITY AS e(value, n) ORDER BY e.n;
  -- Read after the appends: the chain trigger moved the head on this row.
  RETURN QUERY SELECT * FROM actions WHERE action_id = p_action_id;
END $$;
"""

# The chain trigger anchors the head on the action row as the owner, so no writing role needs a
# privilege on actions.ledger_seq / ledger_head.
CHAIN_DEFINER = """
ALTER FUNCTION ledger_chain() SECURITY DEFINER;
ALTER FUNCTION ledger_chain() SET search_path = public, pg_temp;
"""


def grants_sql(database: str) -> str:
    all_roles = ", ".join(ROLES)
    writers = ", ".join((CONTROLLER, WORKER, OPERATOR))
    worker_action_columns = ("status, outcome, finding, reason_code, result, recovery_data, recovery_kind, "
                             "updated_at, next_check_at")
    return f"""
GRANT CONNECT ON DATABASE "{database}" TO {all_roles};
GRANT USAGE ON SCHEMA public TO {all_roles};
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
-- No temporary tables either: nothing may shadow a rule table, whatever search_path a caller sets.
REVOKE TEMPORARY ON DATABASE "{database}" FROM PUBLIC;
-- Start from nothing: proofline_runtime's old table-wide rights go, it inherits worker + recovery.
REVOKE ALL ON {", ".join(TABLES)} FROM {RUNTIME}, {all_roles};
REVOKE ALL ON SEQUENCE lease_fencing_seq, kill_switches_id_seq, ledger_events_id_seq FROM {RUNTIME};
GRANT SELECT ON {", ".join(TABLES)} TO {all_roles};
GRANT EXECUTE ON FUNCTION ledger_event_hash(text, text, integer, text, text, timestamptz, jsonb) TO {all_roles};

GRANT INSERT ON ledger_events TO {writers};
GRANT USAGE ON SEQUENCE ledger_events_id_seq TO {writers};

GRANT INSERT ON actions TO {CONTROLLER}, {RECOVERY};
GRANT UPDATE ({worker_action_columns}) ON actions TO {WORKER}, {OPERATOR};
GRANT UPDATE (cancel_requested_at, cancel_requested_by, cancel_reason) ON actions TO {OPERATOR};

GRANT INSERT ON idempotency_records TO {WORKER};
GRANT UPDATE (status, result, fencing_token, attempts, updated_at) ON idempotency_records TO {WORKER};
GRANT INSERT, UPDATE ON leases TO {WORKER};
GRANT USAGE ON SEQUENCE lease_fencing_seq TO {WORKER};

GRANT INSERT ON kill_switches, revoked_identities TO {OPERATOR};
GRANT UPDATE (cleared_by, cleared_at) ON kill_switches TO {OPERATOR};
GRANT USAGE ON SEQUENCE kill_switches_id_seq TO {OPERATOR};

REVOKE ALL ON FUNCTION proofline_contain(text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION proofline_contain(text, text, text) TO {WORKER}, {OPERATOR};
"""


DOWNGRADE = """
DROP TRIGGER kill_switch_guard ON kill_switches;
DROP TRIGGER ledger_events_authorize ON ledger_events;
DROP TRIGGER idempotency_guard ON idempotency_records;
DROP TRIGGER actions_guard ON actions;
DROP FUNCTION proofline_transition(text, action_status[], action_status, outcome_class, text, text, jsonb, jsonb,
  recovery_kind, text, jsonb);
DROP FUNCTION proofline_contain(text, text, text), kill_switch_guard(), ledger_event_guard(), idempotency_guard(),
  actions_guard(), proofline_acts_as(text[]), proofline_trusted();
DROP TABLE ledger_event_rights, idempotency_transitions, action_transitions;
ALTER FUNCTION ledger_chain() SECURITY INVOKER;
ALTER FUNCTION ledger_chain() RESET search_path;
"""


# --- the protected evidence store (migration 0018) -------------------------------------------------

CREATE_AUDITOR = f"""DO $$ BEGIN CREATE ROLE {AUDITOR} LOGIN;
EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$;"""


def evidence_store_grants_sql(database: str) -> str:
    """Who may touch ``evidence_captures``: the worker (so recovery and the runtime) inserts and
    never reads; the auditor reads, appends its ``evidence_read_by_auditor`` events and reads the
    ledger; every other role, and PUBLIC, has no right on the store at all."""
    others = ", ".join((*ROLES, RUNTIME, AUDITOR))
    return f"""
REVOKE ALL ON evidence_captures FROM PUBLIC, {others};
GRANT INSERT ON evidence_captures TO {WORKER};
GRANT CONNECT ON DATABASE "{database}" TO {AUDITOR};
GRANT USAGE ON SCHEMA public TO {AUDITOR};
GRANT SELECT ON evidence_captures, ledger_events, actions, ledger_event_rights TO {AUDITOR};
GRANT INSERT ON ledger_events TO {AUDITOR};
GRANT USAGE ON SEQUENCE ledger_events_id_seq TO {AUDITOR};
GRANT EXECUTE ON FUNCTION ledger_event_hash(text, text, integer, text, text, timestamptz, jsonb) TO {AUDITOR};
"""


EVIDENCE_STORE_DOWNGRADE = f"""
REVOKE ALL ON ledger_events, actions, ledger_event_rights FROM {AUDITOR};
REVOKE ALL ON SEQUENCE ledger_events_id_seq FROM {AUDITOR};
REVOKE ALL ON FUNCTION ledger_event_hash(text, text, integer, text, text, timestamptz, jsonb) FROM {AUDITOR};
"""
