"""The idempotency record's replay window, passed by time itself (no admin UPDATE of the record).

A stack whose workers keep a record for 2 seconds. The refund's call takes longer than that at
the server (a delay fault), and the worker process dies right after sending it, before anything
is recorded. When the message is delivered again the record is past its window: the runtime does
not guess whether the call took effect; it calls nothing again and hands the action to an
operator as ``replay_window_expired``. One call reached the server (the witness), and the system
of record applied one refund.
"""

from __future__ import annotations

import psycopg

from ledger.states import ActionStatus, Outcome
from proofline_kit.sor import store as sor
from tests.conftest import build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import new_account, refund_env
from worker.faultpoints import arm, fired

WINDOW_SECONDS = 2.0


def test_a_redelivery_past_the_replay_window_is_escalated_not_called(tmp_path) -> None:
    s = build_stack("stdio", tmp_path, extra_env={"PROOFLINE_REPLAY_WINDOW_SECONDS": str(WINDOW_SECONDS)})
    try:
        start_workers(s, beat=False)
        env = refund_env(s, new_account(s), timeout_seconds=10.0)
        # The server answers only after the window has run out; the pool process dies once it sent.
        sor.set_fault(s.sor_db, "issue_refund", "delay", remaining=1, delay_seconds=WINDOW_SECONDS + 1.5)
        arm(s.faultpoints, "after_send", remaining=1)
        try:
            s.publish(env)
            row = s.wait_settled(env.action_id, timeout=90)
        finally:
            sor.clear_faults(s.sor_db, "issue_refund")
            s.disarm()
        assert fired(s.faultpoints, "after_send") == 1
        with psycopg.connect(s.admin_url) as conn:
            claimed, expired = conn.execute(
                "SELECT created_at, expires_at <= clock_timestamp() FROM idempotency_records WHERE key = %s",
                (env.idempotency_key,)).fetchone()
        assert claimed is not None and expired, "the record aged out of its window on its own"
        assert (row.status, row.outcome, row.reason_code) == (
            ActionStatus.escalated, Outcome.unknown_outcome, "replay_window_expired")
        events = s.events(env.action_id)
        assert "replay_window_expired" in events and "tool_called" not in events
        wait_for(lambda: s.effects(env.idempotency_key) == 1, 20, what="the delayed refund to be applied")
        assert s.witness.count(tool="issue_refund", key=env.idempotency_key) == 1  # sent once, never again
    finally:
        teardown_stack(s)
