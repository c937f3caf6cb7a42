"""A redelivery of a settled action is suppressed at the action row, whatever its idempotency record says.

The record alone is not enough: an action that closed after its only allowed attempt failed before
any side effect leaves the record ``failed``, which is exactly what a retry may claim again. The
broker delivers the message once more (a late redelivery, a replay): it must be suppressed as a
duplicate of a settled action, not claimed, and nothing may reach the server.
"""

from __future__ import annotations

from ledger import store
from ledger.states import ActionStatus, IdempotencyStatus, Outcome
from tests.conftest import Stack, wait_for
from tests.helpers import evidence_of, new_account, refund_env, refund_under_fault


def test_a_redelivery_of_an_action_closed_before_any_effect_is_suppressed(stack: Stack) -> None:
    env = refund_env(stack, new_account(stack), retry_policy={"max_attempts": 1, "backoff_seconds": 0})
    row = refund_under_fault(stack, env, "fail_before_commit", remaining=1)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.failed_before_side_effect), row.reason_code
    with stack.conn.cursor() as cur:
        record = store.get_idempotency_txn(cur, env.idempotency_key)
    # The record would let a retry claim it again: only the action row says the action is over.
    assert record is not None and record.status == IdempotencyStatus.failed
    assert record.attempts < env.authority_budget.max_calls
    calls = stack.witness.count(key=env.idempotency_key, server="sor")
    assert calls == 1

    stack.deliver(stack.message(env))
    wait_for(lambda: evidence_of(stack, env.action_id, "duplicate_suppressed"), 30, what="the redelivery's record")
    [suppressed] = evidence_of(stack, env.action_id, "duplicate_suppressed")
    assert suppressed["status"] == ActionStatus.closed.value
    assert stack.witness.count(key=env.idempotency_key, server="sor") == calls
    assert stack.effects(env.idempotency_key) == 0
    with stack.conn.cursor() as cur:
        after = store.get_idempotency_txn(cur, env.idempotency_key)
    assert after is not None and (after.status, after.attempts) == (IdempotencyStatus.failed, record.attempts)
    assert stack.action(env.action_id).status == ActionStatus.closed
