"""The idempotency record, not only the action row, decides what a delivery under a known key does.

The key is derived from the arguments, so a validly signed message cannot carry other arguments
under the same key; the tool contract hash is not part of the key, though. An action whose first
call failed before any side effect waits for its retry with its record ``failed`` under the
contract it was approved against. The server is then restarted with a changed schema and the
controller republishes the same intent, approved against the new schema: same action id, same
arguments, same key, another contract hash. Every check in front of the claim passes (the key
matches the action row, the contract hash matches the live server); only the record's hashes
differ. The delivery is refused as ``idempotency_conflict`` naming the recorded hashes, and no
second call is made under the key.
"""

from __future__ import annotations

import pytest

from ledger import store
from ledger.states import IdempotencyStatus
from proofline.controller import describe_server
from proofline.errors import IdempotencyConflict
from proofline_kit.sor import store as sor
from tests.conftest import Stack, wait_for
from tests.helpers import evidence_of, ticket_env


# On a stack whose reconciler does not re-drive the waiting action: it would otherwise run it again,
# on the original envelope against the changed server, whenever restarting the writer takes longer
# than the usual re-drive age (3 s), and close it before the republication arrives.
@pytest.mark.parametrize("stack", ["http+late-redrive"], indirect=True)
def test_a_key_reused_under_another_contract_is_refused_at_the_record(stack: Stack) -> None:
    # A long backoff keeps the failed action waiting for its retry while the republication arrives.
    env = ticket_env(stack, retry_policy={"max_attempts": 3, "backoff_seconds": 120})
    sor.set_fault(stack.sor_db, "create_ticket", "fail_before_commit", remaining=1)
    try:
        stack.publish(env)
        stack.wait_event(env.action_id, "retry_scheduled", timeout=60)
        with stack.conn.cursor() as cur:
            record = store.get_idempotency_txn(cur, env.idempotency_key)
        assert record is not None and record.status == IdempotencyStatus.failed
        assert (record.argument_hash, record.contract_hash) == (env.arguments_hash, env.tool.contract_hash)

        stack.restart_writer(SOR_CONTRACT_VARIANT="2")
        changed = describe_server(stack.settings, "sor")
        other = stack.envelope("ticket.create", action_id=env.action_id, run_id=env.run_id, arguments=env.arguments,
                               target={"type": env.target.type, "id": env.target.id}, live=changed,
                               retry_policy={"max_attempts": 3, "backoff_seconds": 120})
        assert other.idempotency_key == env.idempotency_key
        assert other.arguments_hash == env.arguments_hash
        assert other.tool.contract_hash != env.tool.contract_hash
        calls_before = stack.witness.count(key=env.idempotency_key, server="sor")
        stack.publish(other)  # same key: recorded as a republication, and sent

        wait_for(lambda: evidence_of(stack, env.action_id, "idempotency_conflict"), 60,
                 what="the record-level conflict")
        [conflict] = evidence_of(stack, env.action_id, "idempotency_conflict")
        assert conflict["reason_code"] == IdempotencyConflict.code
        assert conflict["recorded_argument_hash"] == env.arguments_hash
        assert conflict["recorded_contract_hash"] == env.tool.contract_hash
        # Nothing was called under the key for the republished message, and the record is untouched.
        assert stack.witness.count(key=env.idempotency_key, server="sor") == calls_before
        assert stack.effects(env.idempotency_key) == 0
        with stack.conn.cursor() as cur:
            after = store.get_idempotency_txn(cur, env.idempotency_key)
        assert after is not None
        assert (after.status, after.contract_hash, after.attempts) == (IdempotencyStatus.failed,
                                                                       env.tool.contract_hash, record.attempts)
    finally:
        sor.clear_faults(stack.sor_db, "create_ticket")
        stack.restart_writer()
