"""The seed's runtime validation suite, one test per item of its list, in its order.

Each test injects its fault for real (system-of-record fault switches, the TCP fault proxy, a
restarted server, concurrent deliveries, expired records) and asserts on both the ledger and the
downstream store's own effects log.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest

from ledger import store
from ledger.states import ActionStatus, IdempotencyStatus, KillSwitchScope, Outcome
from proofline.controller import publish_message
from proofline.errors import IdempotencyConflict
from proofline.settings import ROOT
from proofline_kit.sor import store as sor
from recovery.cancel import cancel
from recovery.operator import clear_switch, list_switches, manual_queue, resolve, set_switch
from tests.conftest import Stack, wait_for
from tests.helpers import (
    LosingBroker,
    new_account,
    recovery_action,
    refund_env,
    run_of,
    run_settled,
    stale_close_env,
    ticket_env,
    uid,
)
from worker.dispatch import CeleryDispatch

BOTH = pytest.mark.parametrize("stack", ["stdio", "http"], indirect=True)
ALL_PROTOCOLS = pytest.mark.parametrize("stack", ["stdio", "http", "http-legacy"], indirect=True)
PROXIED = pytest.mark.parametrize("stack", ["http-proxy"], indirect=True)
HTTP = pytest.mark.parametrize("stack", ["http"], indirect=True)


def refund(stack: Stack, account: str, amount: int = 1500, **kw: Any):
    return refund_env(stack, account, amount=amount, **kw)


def tool_called(stack: Stack, action_id: str) -> dict[str, Any]:
    return next(e for e in stack.timeline(action_id) if e["event"] == "tool_called")["evidence"]


# --- 1. duplicate delivery with the same idempotency key ---------------------------------------------


@BOTH
def test_duplicate_delivery_with_the_same_idempotency_key(stack: Stack) -> None:
    # refund.issue's tool pays again on every call: only the runtime stands between a duplicate
    # delivery and a second refund.
    env = refund(stack, new_account(stack))
    stack.publish(env)
    stack.wait_settled(env.action_id)
    message = stack.message(env)
    for _ in range(3):
        stack.deliver(message)
    # Each later delivery is either suppressed (the action is settled) or ignored (another
    # delivery held the action's lease at that moment): never executed.
    def handled() -> int:
        events = stack.events(env.action_id)
        return events.count("duplicate_suppressed") + events.count("redelivery_ignored")

    wait_for(lambda: handled() == 3, 30, what="3 suppressions")
    row = stack.action(env.action_id)
    assert row.outcome == Outcome.completed_verified
    assert stack.effects(env.idempotency_key) == 1


# --- 2. duplicate delivery with conflicting arguments ------------------------------------------------


def test_duplicate_delivery_with_conflicting_arguments(stack: Stack) -> None:
    account = new_account(stack)
    env = refund(stack, account, amount=1000)
    stack.publish(env)
    stack.wait_settled(env.action_id)
    # Same action id, different amount: a correctly signed envelope with a different key.
    other = refund(stack, account, amount=9000, action_id=env.action_id, run_id=env.run_id)
    assert other.idempotency_key != env.idempotency_key
    with pytest.raises(IdempotencyConflict):
        stack.publish(other)
    stack.deliver(stack.message(other))  # as if the broker carried it anyway
    stack.wait_event(env.action_id, "idempotency_conflict")
    assert stack.effects(other.idempotency_key) == 0
    assert stack.effects(env.idempotency_key) == 1
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000 - 1000
    assert stack.action(env.action_id).outcome == Outcome.completed_verified


# --- 3. timeout before downstream receipt -------------------------------------------------------


def test_timeout_before_downstream_receipt(stack: Stack) -> None:
    """The server holds the request without acting past the caller's timeout; the caller's
    cancellation stops it. Unknown outcome → verification proves the effect absent → recovery
    retries with the same key → exactly one refund."""
    account = new_account(stack)
    env = refund(stack, account, timeout_seconds=1.0)
    sor.set_fault(stack.sor_db, "issue_refund", "delay", remaining=1, delay_seconds=3.0)
    stack.publish(env)
    row = stack.wait_settled(env.action_id, timeout=60)
    calls = [e["evidence"] for e in stack.timeline(env.action_id) if e["event"] == "tool_called"]
    assert calls[0]["outcome"] == Outcome.unknown_outcome.value
    decided = [e["evidence"] for e in stack.timeline(env.action_id) if e["event"] == "recovery_decided"]
    assert decided[0]["decision"] == "retry" and decided[0]["facts"]["finding"] == "absent"
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert stack.effects(env.idempotency_key) == 1
    assert len(sor.find_refund_by_key(stack.sor_db, env.idempotency_key)["refunds"]) == 1


# --- 4. timeout after downstream receipt --------------------------------------------------------


@PROXIED
def test_timeout_after_downstream_receipt(stack: Stack) -> None:
    """The request reaches the server, which applies it; the network then black-holes the
    response. Unknown outcome → verified through the independent read path, never re-sent."""
    account = new_account(stack)
    env = refund(stack, account, timeout_seconds=2.0)
    sor.set_fault(stack.sor_db, "issue_refund", "delay", remaining=1, delay_seconds=0.8)
    stack.publish(env)
    try:
        stack.wait_event(env.action_id, "preconditions_passed")
        stack.proxy.set_mode("blackhole", forward_close=False)
        stack.wait_event(env.action_id, "tool_called", timeout=30)
    finally:
        stack.proxy.set_mode("pass")
    assert tool_called(stack, env.action_id)["outcome"] == Outcome.unknown_outcome.value
    assert stack.proxy.stats()["responses_dropped"] >= 1
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert stack.events(env.action_id).count("tool_called") == 1
    assert stack.effects(env.idempotency_key) == 1


# --- 5. lost response after successful mutation ------------------------------------------------------


@ALL_PROTOCOLS
def test_lost_response_after_successful_mutation(stack: Stack) -> None:
    """The seed's most important test: the downstream applies the write and the response is lost;
    the retry (a redelivery of the same envelope) and verification run; exactly one side effect
    exists and the original result is recovered."""
    account = new_account(stack)
    env = refund(stack, account, timeout_seconds=1.0)
    sor.set_fault(stack.sor_db, "issue_refund", "drop_response", remaining=1, delay_seconds=30)
    stack.publish(env)
    stack.wait_event(env.action_id, "tool_called")
    called = next(e for e in stack.timeline(env.action_id) if e["event"] == "tool_called")
    assert called["evidence"]["outcome"] == Outcome.unknown_outcome.value
    stack.deliver(stack.message(env))  # the broker's retry of the same envelope
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert stack.effects(env.idempotency_key) == 1
    assert stack.events(env.action_id).count("tool_called") == 1
    refunds = sor.find_refund_by_key(stack.sor_db, env.idempotency_key)["refunds"]
    assert len(refunds) == 1
    # The original result (the refund's id) is recovered from the system of record.
    assert row.result["recovered_by"] == "verification"
    assert row.result["values"]["refund"]["id"] == refunds[0]["id"]
    with stack.conn.cursor() as cur:
            record = store.get_idempotency_txn(cur, env.idempotency_key)
    assert record.status == IdempotencyStatus.completed


# --- 6. stale resource version -----------------------------------------------------------------------


def test_stale_resource_version(stack: Stack) -> None:
    ticket = sor.put_ticket(stack.sor_db, "acme", "printer", "ops")
    reviewed = sor.get_ticket(stack.sor_db, ticket)["ticket"]["version"]
    env = stack.envelope("ticket.close", arguments={"ticket_id": ticket, "expected_version": reviewed},
                         target={"type": "ticket", "id": ticket, "expected_version": reviewed})
    sor.bump_version(stack.sor_db, "ticket", ticket)  # someone changed it after approval
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "stale_version")
    assert "tool_called" not in stack.events(env.action_id)
    assert stack.effects(env.idempotency_key) == 0
    assert sor.get_ticket(stack.sor_db, ticket)["ticket"]["status"] == "open"


# --- 7. expired approval -----------------------------------------------------------------------------


def test_expired_approval(stack: Stack) -> None:
    env = refund(stack, new_account(stack), approval_ttl=timedelta(seconds=-1))
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "approval_expired")
    assert stack.effects(env.idempotency_key) == 0


# --- 8. revoked workload identity --------------------------------------------------------------------


def test_revoked_workload_identity(stack: Stack) -> None:
    identity = f"agent:rogue-{time.monotonic_ns()}"
    env = refund(stack, new_account(stack), workload_identity=identity)
    with store.transaction(stack.operator) as cur:
        store.revoke_identity_txn(cur, identity, "secops@example.com", "credential leaked")
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "identity_revoked")
    assert stack.effects(env.idempotency_key) == 0


# --- 9. changed tool contract -------------------------------------------------------------------


@HTTP
def test_changed_tool_contract(stack: Stack) -> None:
    """Approved against one schema; the server is restarted with a changed schema before the
    worker runs the action: refused before any effect."""
    env = ticket_env(stack)
    stack.restart_writer(SOR_CONTRACT_VARIANT="2")
    try:
        stack.publish(env)
        row = stack.wait_settled(env.action_id)
    finally:
        stack.restart_writer()
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "tool_contract_changed")
    failed = next(e for e in stack.timeline(env.action_id) if e["event"] == "revalidation_failed")["evidence"]
    assert env.tool.contract_hash in failed["detail"]
    assert stack.effects(env.idempotency_key) == 0
    # With the approved schema back, a fresh approval of the same intent executes.
    again = ticket_env(stack)
    stack.publish(again)
    assert stack.wait_settled(again.action_id).outcome == Outcome.completed_verified


# --- 10. concurrent action against the same target ------------------------------------------------


def test_concurrent_action_against_the_same_target(stack: Stack) -> None:
    """Two different actions, both approved against the same account version, arrive together.
    The target lock serialises them; the second then sees the version the first produced and
    does not start: it is never adapted to the new state."""
    account = new_account(stack)
    first = refund(stack, account, amount=1000)
    second = refund(stack, account, amount=2000)
    sor.set_fault(stack.sor_db, "issue_refund", "delay", remaining=1, delay_seconds=1.5)
    stack.publish(first)
    stack.wait_event(first.action_id, "preconditions_passed")
    stack.publish(second)
    rows = {e.action_id: stack.wait_settled(e.action_id, timeout=60) for e in (first, second)}
    assert rows[first.action_id].outcome == Outcome.completed_verified
    assert (rows[second.action_id].outcome, rows[second.action_id].reason_code) == (Outcome.not_started,
                                                                                    "stale_version")
    assert "target_busy" in stack.events(second.action_id)
    assert stack.effects(first.idempotency_key) == 1 and stack.effects(second.idempotency_key) == 0
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000 - 1000


# --- 11. task record expiration -----------------------------------------------------------------


def test_task_record_expiration(stack: Stack) -> None:
    """The worker dies after the downstream applied the write and before it recorded anything;
    by the time the message is delivered again, the idempotency record is past its replay window.
    The runtime refuses to guess: nothing is called again, the action goes to an operator."""
    from worker.faultpoints import arm, fired

    account = new_account(stack)
    env = refund(stack, account)
    sor.set_fault(stack.sor_db, "issue_refund", "delay", remaining=1, delay_seconds=1.5)
    arm(stack.faultpoints, "after_send", remaining=1)
    stack.publish(env)
    stack.wait_event(env.action_id, "idempotency_claimed")
    with psycopg_admin(stack) as conn:  # time passes: the record ages out of its replay window
        conn.execute("UPDATE idempotency_records SET expires_at = clock_timestamp() - interval '1 second' "
                     "WHERE key = %s", (env.idempotency_key,))
    row = stack.wait_settled(env.action_id, timeout=60)
    assert fired(stack.faultpoints, "after_send") == 1
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.escalated, Outcome.unknown_outcome,
                                                          "replay_window_expired")
    assert "replay_window_expired" in stack.events(env.action_id)
    assert "tool_called" not in stack.events(env.action_id)
    assert stack.effects(env.idempotency_key) == 1  # applied once by the worker that died; never again
    wait_for(stack.workers_alive, 10, what="Celery to replace the killed pool process")


def psycopg_admin(stack: Stack):
    import psycopg

    return psycopg.connect(stack.admin_url, autocommit=True)


# --- 12. ignored cancellation ------------------------------------------------------------------------


def test_ignored_cancellation(stack: Stack) -> None:
    account = new_account(stack)
    env = refund_env(stack, account, cancellation="reconcile_then_compensate")
    # The server applies the refund and then keeps the request open: a cancellation cannot stop it.
    sor.set_fault(stack.sor_db, "issue_refund", "drop_response", remaining=1, delay_seconds=3)
    stack.publish(env)
    stack.wait_event(env.action_id, "preconditions_passed")
    wait_for(lambda: stack.effects(env.idempotency_key) == 1, 20, what="the refund to be applied")
    result = cancel(stack.operator, CeleryDispatch(stack.app), env.action_id, "ops@example.com", "wrong customer")
    assert result["accepted"] and result["disposition"] == "awaiting external state"
    row = stack.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome) == (ActionStatus.cancelled, Outcome.compensated)
    called = next(e for e in stack.timeline(env.action_id) if e["event"] == "tool_called")["evidence"]
    assert called["reason_code"] in ("cancelled_in_flight", "response_lost")
    # Reconciled from the system of record: one refund happened, and it was reversed once.
    refund = sor.find_refund_by_key(stack.sor_db, env.idempotency_key)["refunds"]
    assert len(refund) == 1 and refund[0]["status"] == "reversed"
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000


# --- 13. progress notification flood -----------------------------------------------------------------


def test_progress_notification_flood(stack: Stack) -> None:
    name = f"svc-{time.monotonic_ns()}"
    sor.put_service(stack.sor_db, name, "acme")
    gen = sor.get_service(stack.sor_db, name)["generation"]
    env = stack.envelope("service.restart", arguments={"service": name, "tenant": "acme", "expected_generation": gen},
                         target={"type": "service", "id": name, "expected_version": gen})
    sor.set_fault(stack.sor_db, "restart_service", "progress_flood", remaining=1, delay_seconds=2.0)
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert row.outcome == Outcome.completed_verified
    called = next(e for e in stack.timeline(env.action_id) if e["event"] == "tool_called")["evidence"]
    assert called["progress_total"] >= 100
    assert len(called["progress"]) == 5  # PROOFLINE_PROGRESS_EVENTS_LIMIT in the test stack
    assert stack.effects(env.idempotency_key) == 1


# --- 14. partial multi-step completion ---------------------------------------------------------------


def test_partial_multi_step_completion(stack: Stack) -> None:
    account = new_account(stack)
    steps = run_of(stack, [
        lambda **kw: ticket_env(stack, **kw),
        lambda **kw: refund_env(stack, account, **kw),
        lambda **kw: stale_close_env(stack, **kw),
    ])
    stack.publish_run(steps)
    summary = run_settled(stack, steps[0].run_id)
    assert summary["outcome"] == "compensated"
    rows = [stack.action(e.action_id) for e in steps]
    assert [r.outcome for r in rows] == [Outcome.compensated, Outcome.compensated, Outcome.not_started]
    assert rows[2].reason_code == "stale_version"
    # Each compensation ran as its own verified action, the later step first.
    comps = [stack.action(recovery_action(stack, e.action_id)) for e in steps[:2]]
    assert all(c.outcome == Outcome.completed_verified for c in comps)
    assert comps[1].published_at < comps[0].published_at
    # Downstream: the refund is reversed and the created ticket closed, each exactly once.
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000
    refund = sor.find_refund_by_key(stack.sor_db, steps[1].idempotency_key)["refund"]
    assert refund["status"] == "reversed"
    ticket = sor.find_ticket_by_key(stack.sor_db, steps[0].idempotency_key)["ticket"]
    assert ticket["status"] == "closed"
    for comp in comps:
        assert stack.effects(comp.idempotency_key) == 1
    assert stack.effects(steps[0].idempotency_key) == 1 and stack.effects(steps[1].idempotency_key) == 1


# --- 15. verification API outage ---------------------------------------------------------------------


def test_verification_api_outage(stack: Stack) -> None:
    account = new_account(stack)
    env = refund_env(stack, account)
    sor.set_read_outage(stack.sor_db, True, role="reader")  # the verification read path is down
    try:
        stack.publish(env)
        row = stack.wait_settled(env.action_id, timeout=60)
    finally:
        sor.set_read_outage(stack.sor_db, False, role="reader")
    assert (row.status, row.outcome, row.finding) == (ActionStatus.escalated, Outcome.completed_unverified,
                                                       "unavailable")
    assert stack.events(env.action_id).count("tool_called") == 1
    assert stack.effects(env.idempotency_key) == 1  # never a second write to "make sure"


# --- 16. eventual consistency delay ------------------------------------------------------------------


def test_eventual_consistency_delay(stack: Stack) -> None:
    name = f"svc-{uid()}"
    sor.put_service(stack.sor_db, name, "acme")
    gen = sor.get_service(stack.sor_db, name)["generation"]
    env = stack.envelope("service.restart", arguments={"service": name, "tenant": "acme", "expected_generation": gen},
                         target={"type": "service", "id": name, "expected_version": gen})
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    finished = next(e for e in stack.timeline(env.action_id) if e["event"] == "verification_finished")["evidence"]
    findings = [t["finding"] for t in finished["timeline"]]
    assert findings[0] == "tolerated" and findings[-1] == "expected"  # warming up, then healthy
    called = next(e for e in stack.timeline(env.action_id) if e["event"] == "tool_called")["evidence"]
    assert called["outcome"] == Outcome.accepted.value and called["downstream_operation_id"].startswith("op-")


# --- 17. compensation retry --------------------------------------------------------------------------


def test_compensation_retry(stack: Stack) -> None:
    steps = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: stale_close_env(stack, **kw)])
    # The compensation (close_ticket) applies, and its response is lost.
    sor.set_fault(stack.sor_db, "close_ticket", "drop_response", remaining=1, delay_seconds=30)
    stack.publish_run(steps)
    assert run_settled(stack, steps[0].run_id)["outcome"] == "compensated"
    comp_id = recovery_action(stack, steps[0].action_id)
    comp = stack.action(comp_id)
    called = next(e for e in stack.timeline(comp_id) if e["event"] == "tool_called")["evidence"]
    assert called["outcome"] == Outcome.unknown_outcome.value
    assert comp.outcome == Outcome.completed_verified
    assert stack.effects(comp.idempotency_key) == 1
    assert stack.events(comp_id).count("tool_called") == 1
    assert stack.action(steps[0].action_id).outcome == Outcome.compensated


# --- 18. compensation failure ------------------------------------------------------------------------


def test_compensation_failure(stack: Stack) -> None:
    steps = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: stale_close_env(stack, **kw)])
    # Step 1 is held until step 0 is verified; change the created ticket before compensation
    # runs, so compensating would overwrite a legitimate concurrent change: it must refuse.
    sor.set_fault(stack.sor_db, "close_ticket", "fail_before_commit", remaining=-1)
    try:
        stack.publish_run(steps)
        parent = wait_for(lambda: (r := stack.action(steps[0].action_id)) and r.status == ActionStatus.escalated
                          and r, 60, what="compensation_failed")
    finally:
        sor.clear_faults(stack.sor_db)
    assert parent.outcome == Outcome.compensation_failed
    assert "compensation_failed" in stack.events(steps[0].action_id)
    switches = {(s["scope"], s["value"]) for s in list_switches(stack.conn)}
    assert ("tool_tenant", "create_ticket@acme") in switches
    # The ticket is still open: the failed compensation applied nothing.
    assert sor.find_ticket_by_key(stack.sor_db, steps[0].idempotency_key)["ticket"]["status"] == "open"
    # Automation is blocked for that tool and tenant: a new action does not start.
    blocked = ticket_env(stack)
    stack.publish(blocked)
    row = stack.wait_settled(blocked.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "kill_switch_engaged")
    assert stack.effects(blocked.idempotency_key) == 0
    # It is in the manual queue with its evidence, and an operator can resolve it.
    queued = {r["action_id"]: r for r in manual_queue(stack.conn)}
    assert steps[0].action_id in queued
    assert any(e["event"] == "compensation_failed" for e in queued[steps[0].action_id]["evidence"])
    resolve(stack.operator, steps[0].action_id, "compensated", "oncall@example.com", "closed by hand",
            {"ticket": "closed in the UI"})
    assert stack.action(steps[0].action_id).reason_code == "operator_compensated"
    assert "operator_intervention" in stack.events(steps[0].action_id)
    clear_switch(stack.operator, KillSwitchScope.tool_tenant, "create_ticket@acme", "oncall@example.com", "resolved")


# --- 19. operator kill switch ------------------------------------------------------------------------


def test_operator_kill_switch(stack: Stack) -> None:
    account = new_account(stack)
    envs = [refund_env(stack, account, amount=100 + n) for n in range(3)]
    broker = LosingBroker()
    for env in envs:
        publish_message(stack.conn, broker, stack.message(env), env, seal_key=stack.seal_key, settings=stack.settings)
    set_switch(stack.operator, KillSwitchScope.tool, "issue_refund", "secops@example.com", "refund fraud suspected")
    try:
        for message in broker.lost:  # the queued messages now reach the workers
            stack.deliver(message)
        rows = [stack.wait_settled(e.action_id) for e in envs]
    finally:
        clear_switch(stack.operator, KillSwitchScope.tool, "issue_refund", "secops@example.com", "cleared")
    assert all((r.outcome, r.reason_code) == (Outcome.not_started, "kill_switch_engaged") for r in rows)
    assert all(stack.effects(e.idempotency_key) == 0 for e in envs)
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000
    events = [e for e in stack.timeline("killswitch:tool:issue_refund")]
    assert [e["event"] for e in events][-2:] == ["kill_switch_set", "kill_switch_cleared"]


# --- 20. forensic reconstruction from evidence -------------------------------------------------------


def test_forensic_reconstruction_from_evidence(stack: Stack) -> None:
    steps = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: stale_close_env(stack, **kw)])
    stack.publish_run(steps)
    run_settled(stack, steps[0].run_id)
    env = dict(__import__("os").environ, PROOFLINE_DATABASE_URL=stack.database_url, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "proofline", "forensics", steps[0].action_id], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "ledger chain intact" in text
    assert "1. Authorized" in text and "operator@example.com" in text and "agent:ops-assistant" in text
    assert f"approval apr-{steps[0].action_id}" in text
    assert "3. Executed" in text and "classified completed_unverified" in text
    assert "4. What changed" in text and "finding expected" in text
    assert "decided compensation (run_step_failed)" in text
    comp = recovery_action(stack, steps[0].action_id)
    assert f"ACTION {comp}" in text  # the compensation's own story, nested
    assert "compensated" in text.split("6. Final state")[-1]
    with stack.conn.cursor() as cur:
        assert store.get_action(cur, steps[0].action_id).outcome == Outcome.compensated
    json.dumps(text)  # printable as a single document

