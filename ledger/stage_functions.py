"""The SQL of migration 0012: server-side functions that make a worker stage one statement.

Each runs ``SECURITY INVOKER`` (the default, on purpose): the role guards of migration 0003 see
the worker's own role, exactly as for the separate statements they replace, and the function can
do nothing the caller could not. A refusal raises a SQLSTATE of its own, turned into the matching
domain error by ``ledger/store.py``:

- ``PL101`` a guarded action transition moved no row (``TransitionRefused``);
- ``PL102`` an idempotency record or lease is not held by this fencing token (``StaleLease``);
- ``PL103`` this session no longer holds the action's advisory locks (``LeaseBusy``, ``lost``).
"""

from __future__ import annotations

FUNCTIONS = r"""
-- Record (or take over) the lease under a token from lease_fencing_seq, after checking that this
-- session still holds both advisory locks. A token never goes backwards on a lease row.
CREATE FUNCTION proofline_take_lease(
    p_action_id text, p_target_key text, p_lock_action text, p_lock_target text, p_host text, p_pid integer,
    p_worker text, p_token bigint, p_ttl double precision) RETURNS bigint
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
DECLARE
  token bigint;
BEGIN
  -- An advisory lock on a bigint key shows as classid = high 32 bits, objid = low 32 bits.
  IF (SELECT count(*) FROM pg_catalog.pg_locks l
       WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid() AND l.granted AND l.objsubid = 1
         AND ((l.classid::bigint << 32) | l.objid::bigint)
             = ANY (ARRAY[hashtextextended(p_lock_action, 0), hashtextextended(p_lock_target, 0)])) <> 2 THEN
    RAISE EXCEPTION 'the advisory locks taken for % are no longer held by this session', p_action_id
      USING ERRCODE = 'PL103';
  END IF;
  INSERT INTO leases AS l (action_id, target_key, owner_host, owner_pid, worker_id, fencing_token, expires_at)
  VALUES (p_action_id, p_target_key, p_host, p_pid, p_worker, COALESCE(p_token, nextval('lease_fencing_seq')),
          clock_timestamp() + make_interval(secs => p_ttl))
  ON CONFLICT (action_id) DO UPDATE SET target_key = EXCLUDED.target_key, owner_host = EXCLUDED.owner_host,
      owner_pid = EXCLUDED.owner_pid, worker_id = EXCLUDED.worker_id, fencing_token = EXCLUDED.fencing_token,
      acquired_at = clock_timestamp(), heartbeat_at = clock_timestamp(), expires_at = EXCLUDED.expires_at,
      released_at = NULL
    WHERE l.fencing_token < EXCLUDED.fencing_token
  RETURNING fencing_token INTO token;
  IF token IS NULL THEN
    RAISE EXCEPTION 'lease of % is held under a newer fencing token than %', p_action_id, p_token
      USING ERRCODE = 'PL102';
  END IF;
  RETURN token;
END $$;

-- proofline_transition (migration 0003), raising PL101 when no row moved, so that a caller can
-- queue it in a pipeline with its COMMIT and still have a refusal roll everything back.
CREATE FUNCTION proofline_transition_strict(
    p_action_id text, p_allowed action_status[], p_status action_status, p_outcome outcome_class,
    p_finding text, p_reason text, p_result jsonb, p_recovery jsonb, p_kind recovery_kind,
    p_actor text, p_events jsonb) RETURNS void
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM proofline_transition(p_action_id, p_allowed, p_status, p_outcome, p_finding,
                                                     p_reason, p_result, p_recovery, p_kind, p_actor, p_events)) THEN
    RAISE EXCEPTION '%: % -> % not allowed', p_action_id,
      COALESCE((SELECT status::text FROM actions WHERE action_id = p_action_id), 'missing'), p_status
      USING ERRCODE = 'PL101';
  END IF;
END $$;

-- The guarded move of an idempotency record by the holder of its fencing token. Returns the
-- attempts made so far; when no row moved, NULL, or with p_strict the refusal PL102.
CREATE FUNCTION proofline_idempotency_move(
    p_key text, p_token bigint, p_allowed idempotency_status[], p_status idempotency_status, p_result jsonb,
    p_new_token bigint, p_attempt integer, p_strict boolean) RETURNS integer
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
DECLARE
  n integer;
BEGIN
  UPDATE idempotency_records SET status = p_status, result = COALESCE(p_result, result),
         fencing_token = COALESCE(p_new_token, fencing_token), attempts = attempts + p_attempt,
         updated_at = clock_timestamp()
   WHERE key = p_key AND fencing_token = p_token AND status = ANY (p_allowed)
  RETURNING attempts INTO n;
  IF n IS NULL AND p_strict THEN
    RAISE EXCEPTION 'idempotency record % is not held by fencing token %', p_key, p_token USING ERRCODE = 'PL102';
  END IF;
  RETURN n;
END $$;

-- A first delivery's whole claim stage in one statement: claim the idempotency record; only if it
-- was free, record the lease (lock check included) and move the action to executing with the
-- pre-call evidence. When the key already has a record nothing is written and false is returned:
-- the caller dispatches on that record (worker/claim.py) in a transaction of its own.
CREATE FUNCTION proofline_claim(
    p_action_id text, p_target_key text, p_lock_action text, p_lock_target text, p_host text, p_pid integer,
    p_worker text, p_token bigint, p_ttl double precision, p_key text, p_tenant text, p_argument_hash text,
    p_contract_hash text, p_window double precision, p_recovery jsonb, p_events jsonb) RETURNS boolean
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
BEGIN
  INSERT INTO idempotency_records (key, action_id, tenant, argument_hash, contract_hash, status, fencing_token,
                                   expires_at)
  VALUES (p_key, p_action_id, p_tenant, p_argument_hash, p_contract_hash, 'in_progress', p_token,
          clock_timestamp() + make_interval(secs => p_window))
  ON CONFLICT (key) DO NOTHING;
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  PERFORM proofline_take_lease(p_action_id, p_target_key, p_lock_action, p_lock_target, p_host, p_pid, p_worker,
                               p_token, p_ttl);
  PERFORM proofline_transition_strict(p_action_id, ARRAY['published', 'executing']::action_status[], 'executing',
                                      NULL, NULL, NULL, NULL, p_recovery, NULL, p_worker, p_events);
  RETURN true;
END $$;
"""

DROP = """
DROP FUNCTION proofline_claim(text, text, text, text, text, integer, text, bigint, double precision, text, text,
  text, text, double precision, jsonb, jsonb);
DROP FUNCTION proofline_idempotency_move(text, bigint, idempotency_status[], idempotency_status, jsonb, bigint,
  integer, boolean);
DROP FUNCTION proofline_transition_strict(text, action_status[], action_status, outcome_class, text, text, jsonb,
  jsonb, recovery_kind, text, jsonb);
DROP FUNCTION proofline_take_lease(text, text, text, text, text, integer, text, bigint, double precision);
"""
