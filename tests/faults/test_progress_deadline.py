"""Progress that keeps coming past the absolute deadline never extends it.

The server floods progress notifications for far longer than the envelope's deadline allows (tens
of thousands, only then would it apply the refund). The runtime records a bounded sample, counts
the rest, and cuts the call when the absolute deadline is reached: the call is recorded as an
unknown outcome before the server finished, the server is told the call was cancelled, nothing
is retried past the deadline, and no refund exists.
"""

from __future__ import annotations

from datetime import timedelta

from ledger.states import Outcome
from proofline_kit.sor import store as sor
from tests.conftest import Stack
from tests.helpers import new_account, refund_env

#: ``progress_flood`` sends ``delay_seconds * 100`` notifications before it acts.
FLOOD = 300.0
#: Seconds from the envelope's creation to its absolute deadline.
DEADLINE = 12
#: How long after the deadline the cut call may be recorded (the ledger write, on a loaded machine).
RECORDED_WITHIN = 5


def test_progress_past_the_deadline_does_not_extend_it(stack: Stack) -> None:
    # The deadline leaves room for a worker that has yet to start its sandboxed sessions on a loaded
    # machine (several seconds each); the flood outlasts it by minutes either way.
    env = refund_env(stack, new_account(stack), deadline_in=timedelta(seconds=DEADLINE), timeout_seconds=5)
    sor.set_fault(stack.sor_db, "issue_refund", "progress_flood", remaining=1, delay_seconds=FLOOD)
    try:
        stack.publish(env)
        stack.wait_event(env.action_id, "tool_called", timeout=30)
        [called] = [e for e in stack.timeline(env.action_id) if e["event"] == "tool_called"]
        row = stack.wait_settled(env.action_id, timeout=60)
    finally:
        sor.clear_faults(stack.sor_db, "issue_refund")
    evidence = called["evidence"]
    assert evidence["outcome"] == Outcome.unknown_outcome.value
    # Progress was flowing when the call was cut, and far less of it than the server would send.
    assert 0 < evidence["progress_total"] < FLOOD * 100
    assert len(evidence["progress"]) <= stack.settings.progress_events_limit
    # The cut came at the deadline, not when the progress stopped: the call was recorded within the
    # time the ledger needs to write it after the deadline (the flood would have run far longer).
    assert called["at"] <= env.deadline + timedelta(seconds=RECORDED_WITHIN), (called["at"], env.deadline)
    [call] = stack.witness.calls(key=env.idempotency_key)
    assert call.cancelled and call.progress >= evidence["progress_total"] > 0
    assert row.outcome != Outcome.completed_verified
    assert stack.events(env.action_id).count("tool_called") == 1  # nothing retried past the deadline
    assert stack.witness.count(key=env.idempotency_key) == 1
    assert stack.effects(env.idempotency_key) == 0
