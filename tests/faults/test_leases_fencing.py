"""A frozen worker past its lease, and the fencing token that keeps its late write out.

The pool process running a refund is stopped (SIGSTOP) while the system of record is applying the
call. Its heartbeats stop; Postgres ends its idle session after the lease TTL, freeing its locks;
the reconciler sees the expired lease and re-sends the stored message; another worker takes the
lease with a new fencing token, finds the claim in progress, and settles the action from the
system of record without calling again. Then the frozen process is resumed (SIGCONT): it holds a
result, and its write under the old token is refused and recorded as ``stale_write_refused``. The
action keeps the verdict the new holder proved; the server was handed one call, carrying the old
token, and the refund exists once.

In that run the status guard refuses the late write too (the record is no longer ``in_progress``).
The second test builds the case where only the token can: the late write arrives while a retry
holds the record ``in_progress`` again under a newer token.
"""

from __future__ import annotations

import os
import signal

import psycopg
import pytest

from ledger.states import ActionStatus, Outcome
from proofline.errors import StaleLease
from proofline_kit.sor import store as sor
from tests.conftest import build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import new_account, refund_env
from worker import faultpoints

# Each test starts two worker nodes and freezes one: 94 s on a slow day against the suite's default
# of 180 s. The limit only ends a hang.
pytestmark = pytest.mark.timeout(600)

#: How long the server holds the call before it applies it and answers.
HELD_SECONDS = 6.0


def test_frozen_worker_past_its_lease_cannot_write_late(tmp_path) -> None:
    s = build_stack("stdio", tmp_path)
    frozen = None
    try:
        start_workers(s, name="a")
        start_workers(s, name="b", beat=False)
        env = refund_env(s, new_account(s), timeout_seconds=8)
        # The server takes a while to apply the call (six seconds: room for this process to see the
        # call and freeze its sender on a loaded machine), so the worker is frozen with the call open.
        sor.set_fault(s.sor_db, "issue_refund", "delay", remaining=1, delay_seconds=HELD_SECONDS)
        s.publish(env)
        # The first call waits for the worker's sandboxed sessions to start: seconds each when loaded.
        wait_for(lambda: s.witness.count(key=env.idempotency_key) == 1, 120, what="the call at the server")
        with psycopg.connect(s.admin_url) as admin:
            owner, first_token = admin.execute("SELECT owner_pid, fencing_token FROM leases WHERE action_id = %s",
                                               (env.action_id,)).fetchone()
        os.kill(owner, signal.SIGSTOP)
        frozen = owner

        # Another holder takes over and settles the action from the system of record.
        # The new holder starts its own read sessions first (the system of record's and the audit's).
        row = s.wait_settled(env.action_id, timeout=180)
        assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
        timeline = s.timeline(env.action_id)
        takeover = [e["evidence"] for e in timeline if e["event"] == "reconcile_required"]
        assert takeover and takeover[0]["previous_fencing_token"] == first_token
        assert takeover[0]["fencing_token"] > first_token
        assert any(e["event"] == "redriven" and e["evidence"]["reason"] == "lease_expired" for e in timeline)
        assert "tool_called" not in [e["event"] for e in timeline]  # the frozen holder has not written yet

        os.kill(owner, signal.SIGCONT)
        frozen = None
        wait_for(lambda: "stale_write_refused" in s.events(env.action_id), 120, what="the late write to be refused")
        refused = [e for e in s.timeline(env.action_id) if e["event"] == "stale_write_refused"]
        assert len(refused) == 1 and refused[0]["evidence"]["reason_code"] == StaleLease.code
        assert refused[0]["evidence"]["observed"]["outcome"] in (Outcome.completed_unverified.value,
                                                                 Outcome.unknown_outcome.value)
        # Nothing the late holder saw changed the action or the idempotency record.
        after = s.action(env.action_id)
        assert (after.status, after.outcome, after.reason_code) == (row.status, row.outcome, row.reason_code)
        assert "tool_called" not in s.events(env.action_id)
        with psycopg.connect(s.admin_url) as admin:
            record_token = admin.execute("SELECT fencing_token FROM idempotency_records WHERE key = %s",
                                         (env.idempotency_key,)).fetchone()[0]
        assert record_token == takeover[0]["fencing_token"]
        [call] = s.witness.calls(key=env.idempotency_key)
        assert call.fencing_token == first_token
        assert s.effects(env.idempotency_key) == 1
        assert s.workers_alive()
    finally:
        clean_up(s, frozen)


def test_a_late_write_is_refused_by_its_token_while_the_record_is_in_progress_again(tmp_path) -> None:
    """The status guard cannot stop this late write: only the fencing token does.

    The first holder's call is refused by the server before any commit, and the holder is frozen
    holding that answer (held at ``after_send``, then SIGSTOP). Its lease expires; another worker
    takes over, verification proves the effect absent, and recovery retries the same key: the
    retry reclaims the record (``failed`` -> ``in_progress`` under a newer token) and is held just
    before its own call. Now the record is ``in_progress`` and the action ``executing``, exactly
    what the frozen holder's write expects. It is resumed: its write carries the old token and is
    refused (``stale_write_refused``); the retry then makes the one call that applies."""
    s = build_stack("stdio", tmp_path)
    frozen = None
    try:
        start_workers(s, name="a")
        start_workers(s, name="b", beat=False)
        env = refund_env(s, new_account(s), timeout_seconds=8, retry_policy={"max_attempts": 3, "backoff_seconds": 0})
        sor.set_fault(s.sor_db, "issue_refund", "fail_before_commit", remaining=1)
        faultpoints.arm(s.faultpoints, "after_send", remaining=1, action="hold", seconds=300)
        s.publish(env)
        wait_for(lambda: faultpoints.fired(s.faultpoints, "after_send") == 1, 60, what="the first call answered")
        with psycopg.connect(s.admin_url) as admin:
            owner, first_token = admin.execute("SELECT owner_pid, fencing_token FROM leases WHERE action_id = %s",
                                               (env.action_id,)).fetchone()
        os.kill(owner, signal.SIGSTOP)
        frozen = owner
        # The retry that follows the takeover waits before its call, holding the record.
        faultpoints.arm(s.faultpoints, "before_send", remaining=1, action="hold", seconds=300)
        wait_for(lambda: faultpoints.fired(s.faultpoints, "before_send") == 1, 120, what="the retry to reclaim")

        def record() -> tuple[str, int]:
            with psycopg.connect(s.admin_url) as admin:
                return admin.execute("SELECT status, fencing_token FROM idempotency_records WHERE key = %s",
                                     (env.idempotency_key,)).fetchone()

        status, retry_token = record()
        assert status == "in_progress" and retry_token > first_token
        assert s.action(env.action_id).status == ActionStatus.executing
        assert "idempotency_reclaimed" in s.events(env.action_id)

        os.kill(owner, signal.SIGCONT)
        frozen = None
        faultpoints.release(s.faultpoints, "after_send")
        wait_for(lambda: {"stale_write_refused", "tool_called"} & set(s.events(env.action_id)), 60,
                 what="the late holder's write")
        refused = [e for e in s.timeline(env.action_id) if e["event"] == "stale_write_refused"]
        assert len(refused) == 1 and refused[0]["evidence"]["reason_code"] == StaleLease.code
        assert "tool_called" not in s.events(env.action_id)
        assert record() == ("in_progress", retry_token)  # the late write moved nothing

        faultpoints.release(s.faultpoints, "before_send")
        row = s.wait_settled(env.action_id, timeout=90)
        assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
        tokens = [c.fencing_token for c in s.witness.calls(key=env.idempotency_key)]
        assert tokens == [first_token, retry_token]
        assert s.effects(env.idempotency_key) == 1
        assert s.workers_alive()
    finally:
        clean_up(s, frozen)


def clean_up(s, frozen: int | None) -> None:
    """Resume a process left frozen, let go of every held fault point, disarm the server, stop all."""
    if frozen is not None:
        os.kill(frozen, signal.SIGCONT)
    for point in ("after_send", "before_send"):
        faultpoints.release(s.faultpoints, point)
    sor.clear_faults(s.sor_db, "issue_refund")
    teardown_stack(s)
