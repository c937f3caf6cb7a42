"""The SQL of migration 0019: pruning as a separately privileged, recorded operation.

The ledger stays insert-only for every runtime role. Removing anything goes through one
``SECURITY DEFINER`` function, :data:`PRUNE_FUNCTION`, owned by the migrating role and executable
only by ``proofline_pruner`` (and the owner). It re-checks every rule itself, whatever the caller
computed: a chain goes only whole, only when its action is settled (``closed``/``cancelled``), past
its deadline, older than its class allows, not on legal hold, with no unsettled compensation and no
live lease, and only when its head is the head the caller's checkpoint anchored. The insert-only
trigger lets a ``DELETE`` of ``ledger_events`` through only inside that function (a transaction-local
setting that only the owning role can make count). Every prune that removes anything appends one
``ledger_pruned`` event to the chain ``ledger:prunes`` with the counts and the head of every chain
removed, so ``verify-ledger`` tells a pruned chain from a deleted one.
"""

from __future__ import annotations

from ledger.ddl import INSERT_ONLY_TRIGGER

#: The chain that records every prune, and its event.
PRUNE_CHAIN = "ledger:prunes"
PRUNE_EVENT = "ledger_pruned"
#: The event an explicit retention class (a legal hold, or lifting one) is recorded with.
HOLD_EVENT = "retention_set"
PRUNER_ROLE = "proofline_pruner"

#: The insert-only trigger, with the single exemption: a DELETE of ledger events by the owning
#: role inside proofline_prune (which sets ``proofline.pruning`` for its own transaction).
REFUSE_CHANGE = r"""
CREATE OR REPLACE FUNCTION ledger_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'DELETE' AND TG_TABLE_NAME = 'ledger_events'
     AND current_setting('proofline.pruning', true) = 'on' AND proofline_trusted() THEN
    RETURN OLD;
  END IF;
  RAISE EXCEPTION 'ledger_events is insert-only (% refused)', TG_OP
    USING ERRCODE = 'insufficient_privilege';
END $$;
"""

#: The function as migration 0001 made it (the downgrade puts it back).
REFUSE_CHANGE_BEFORE = INSERT_ONLY_TRIGGER.split("CREATE TRIGGER", 1)[0]

PRUNE_FUNCTION = rf"""
CREATE FUNCTION proofline_prune(p_chains text[], p_seqs integer[], p_heads text[], p_checkpoint integer,
    p_keep jsonb, p_types jsonb, p_actor text, p_dry boolean) RETURNS jsonb
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
  c record;
  t record;
  last record;
  n bigint;
  cls text;
  heads jsonb := '[]'::jsonb;
  classes jsonb := '{{}}'::jsonb;
  tables jsonb := '{{}}'::jsonb;
  events bigint := 0;
  skipped integer := 0;
BEGIN
  -- One prune at a time; the setting lets the insert-only trigger pass this transaction's deletes.
  PERFORM pg_advisory_xact_lock(hashtextextended('proofline:ledger:prune', 0));
  PERFORM set_config('proofline.pruning', 'on', true);
  FOR c IN
    SELECT u.chain, u.seq, u.head, a.updated_at,
           COALESCE(a.retention_class, p_types->>a.action_type, 'standard') AS cls
      FROM unnest(p_chains, p_seqs, p_heads) AS u(chain, seq, head)
      JOIN actions a ON a.action_id = u.chain
     WHERE a.status IN ('closed', 'cancelled')
       AND a.ledger_seq = u.seq AND a.ledger_head = u.head AND a.deadline < clock_timestamp()
     ORDER BY u.chain
       FOR UPDATE OF a
  LOOP
    cls := c.cls;
    IF cls = 'legal_hold' OR NOT (p_keep ? cls)
       OR c.updated_at >= clock_timestamp() - make_interval(secs => (p_keep->>cls)::double precision)
       OR EXISTS (SELECT 1 FROM actions k WHERE k.parent_action_id = c.chain
                   AND k.status NOT IN ('closed', 'cancelled'))
       OR EXISTS (SELECT 1 FROM leases l WHERE l.action_id = c.chain AND l.released_at IS NULL
                   AND l.expires_at > clock_timestamp()) THEN
      skipped := skipped + 1;
      CONTINUE;
    END IF;
    SELECT max(seq) AS seq, count(*) AS n,
           (array_agg(hash ORDER BY seq DESC))[1] AS hash INTO last
      FROM ledger_events WHERE action_id = c.chain;
    -- The chain must end at the head the checkpoint anchored, with no gap before it.
    IF last.seq IS DISTINCT FROM c.seq OR last.n <> c.seq OR last.hash IS DISTINCT FROM c.head THEN
      skipped := skipped + 1;
      CONTINUE;
    END IF;
    IF NOT p_dry THEN
      DELETE FROM ledger_events WHERE action_id = c.chain;
      DELETE FROM idempotency_records WHERE action_id = c.chain;
      DELETE FROM leases WHERE action_id = c.chain;
      DELETE FROM action_approvals WHERE action_id = c.chain;
      DELETE FROM actions WHERE action_id = c.chain;
    END IF;
    events := events + c.seq;
    heads := heads || jsonb_build_array(jsonb_build_array(c.chain, c.seq, c.head));
    classes := jsonb_set(classes, ARRAY[cls], to_jsonb(COALESCE((classes->>cls)::integer, 0) + 1));
  END LOOP;
  -- Tables with a retention class of their own (retention_tables): rows old enough for their class.
  FOR t IN SELECT * FROM retention_tables ORDER BY table_name LOOP
    EXECUTE format(
      'WITH gone AS (%s FROM %I WHERE %I::text <> ''legal_hold'' AND $1 ? %I::text
          AND %I < clock_timestamp() - make_interval(secs => ($1->>(%I::text))::double precision) AND (%s) %s)
       SELECT count(*) FROM gone',
      CASE WHEN p_dry THEN 'SELECT 1' ELSE 'DELETE' END, t.table_name, t.class_column, t.class_column,
      t.age_column, t.class_column, t.condition, CASE WHEN p_dry THEN '' ELSE 'RETURNING 1' END)
      INTO n USING p_keep;
    tables := jsonb_set(tables, ARRAY[t.table_name], to_jsonb(n));
  END LOOP;
  IF NOT p_dry AND (jsonb_array_length(heads) > 0
                    OR EXISTS (SELECT 1 FROM jsonb_each_text(tables) WHERE value::bigint > 0)) THEN
    INSERT INTO ledger_events (action_id, event, actor, evidence)
    VALUES ('{PRUNE_CHAIN}', '{PRUNE_EVENT}', p_actor,
            jsonb_build_object('checkpoint', p_checkpoint, 'chains', jsonb_array_length(heads),
                               'events', events, 'classes', classes, 'tables', tables,
                               'keep_seconds', p_keep, 'heads', heads));
  END IF;
  RETURN jsonb_build_object('dry_run', p_dry, 'checkpoint', p_checkpoint, 'chains', jsonb_array_length(heads),
                            'events', events, 'skipped', skipped, 'classes', classes, 'tables', tables,
                            'heads', heads);
END $$;
"""

HOLD_FUNCTION = rf"""
CREATE FUNCTION proofline_set_retention(p_action_id text, p_class text, p_by text, p_reason text)
  RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
  UPDATE actions SET retention_class = p_class WHERE action_id = p_action_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no action %', p_action_id USING ERRCODE = 'PL004';
  END IF;
  INSERT INTO ledger_events (action_id, event, actor, evidence)
  VALUES (p_action_id, '{HOLD_EVENT}', p_by,
          jsonb_build_object('retention_class', p_class, 'reason', p_reason));
END $$;
"""

GRANTS = rf"""
DO $$ BEGIN
  CREATE ROLE {PRUNER_ROLE} LOGIN;
EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
END $$;
DO $$ BEGIN
  EXECUTE format('GRANT CONNECT ON DATABASE %I TO {PRUNER_ROLE}', current_database());
END $$;
GRANT USAGE ON SCHEMA public TO {PRUNER_ROLE};
GRANT SELECT ON ALL TABLES IN SCHEMA public TO {PRUNER_ROLE};
REVOKE ALL ON FUNCTION proofline_prune(text[], integer[], text[], integer, jsonb, jsonb, text, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION proofline_prune(text[], integer[], text[], integer, jsonb, jsonb, text, boolean)
  TO {PRUNER_ROLE};
REVOKE ALL ON FUNCTION proofline_set_retention(text, text, text, text) FROM PUBLIC;
DO $$ BEGIN
  IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'proofline_operator') THEN
    GRANT EXECUTE ON FUNCTION proofline_set_retention(text, text, text, text)
      TO proofline_operator, {PRUNER_ROLE};
    GRANT SELECT ON retention_tables TO proofline_controller, proofline_worker, proofline_recovery,
      proofline_operator, proofline_reader;
  END IF;
END $$;
INSERT INTO ledger_event_rights (event, roles) VALUES ('{PRUNE_EVENT}', ARRAY[]::text[]),
  ('{HOLD_EVENT}', ARRAY[]::text[]) ON CONFLICT DO NOTHING;
INSERT INTO retention_tables (table_name, age_column, class_column, condition)
VALUES ('message_deliveries', 'last_at', 'retention_class', 'unsettled = 0'),
       -- the protected evidence store (migration 0018): each capture by the class its contract gave it
       ('evidence_captures', 'captured_at', 'retention', 'true');
"""

DOWNGRADE = f"""
DELETE FROM ledger_event_rights WHERE event IN ('{PRUNE_EVENT}', '{HOLD_EVENT}');
DROP FUNCTION proofline_set_retention(text, text, text, text);
DROP FUNCTION proofline_prune(text[], integer[], text[], integer, jsonb, jsonb, text, boolean);
REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {PRUNER_ROLE};
REVOKE USAGE ON SCHEMA public FROM {PRUNER_ROLE};
DO $$ BEGIN
  EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM {PRUNER_ROLE}', current_database());
END $$;
"""
