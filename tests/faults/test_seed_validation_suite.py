"""The seed's runtime validation suite, one test per item of its list, in its order.

Each test injects its fault for real (system-of-record fault switches, the TCP fault proxy, fault
points that hold a worker at an exact stage until the test releases it, a restarted server,
concurrent deliveries, a server-side record expiry, a lagging read replica, a tampered ledger) and
counts side effects twice: in the system of record's own effects log, and in the transport-level
witness that recorded every ``tools/call`` the runtime sent.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from ledger import store
from ledger.states import ActionStatus, IdempotencyStatus, KillSwitchScope, Outcome
from proofline.conditions import holds
from proofline.contracts import contract_for
from proofline.controller import publish, publish_message
from proofline.errors import IdempotencyConflict
from proofline.settings import ROOT
from proofline_kit import zygote
from proofline_kit.sor import store as sor
from recovery.cancel import cancel
from recovery.operator import clear_switch, list_switches, manual_queue, resolve, set_switch
from tests.conftest import Stack, wait_for
from tests.helpers import (
    LosingBroker,
    evidence_of,
    new_account,
    recovery_action,
    refund_env,
    restart_env,
    run_of,
    run_settled,
    stale_close_env,
    ticket_env,
)
from worker.dispatch import CeleryDispatch
from worker.faultpoints import arm, fired, release

BOTH = pytest.mark.parametrize("stack", ["stdio", "http"], indirect=True)
ALL_PROTOCOLS = pytest.mark.parametrize("stack", ["stdio", "http", "http-legacy"], indirect=True)
PROXIED = pytest.mark.parametrize("stack", ["http-proxy"], indirect=True)
HTTP = pytest.mark.parametrize("stack", ["http"], indirect=True)


def refund(stack: Stack, account: str, amount: int = 1500, **kw: Any):
    return refund_env(stack, account, amount=amount, **kw)


def calls_of(stack: Stack, action_id: str) -> list[dict[str, Any]]:
    """The evidence of every ``tool_called`` event of an action, in order."""
    return [e["evidence"] for e in stack.timeline(action_id) if e["event"] == "tool_called"]



@contextmanager
def held(stack: Stack, point: str, action_id: str) -> Iterator[int]:
    """Arm ``point`` to hold the next worker that reaches it with ``action_id`` (work left over from
    an earlier test cannot take the shot); yields the firing count to wait for. Released (and
    disarmed) on the way out, whatever happened."""
    shot = fired(stack.faultpoints, point) + 1
    arm(stack.faultpoints, point, remaining=1, action="hold", seconds=300, action_id=action_id)
    try:
        yield shot
    finally:
        release(stack.faultpoints, point)


def wait_held(stack: Stack, point: str, shot: int) -> None:
    wait_for(lambda: fired(stack.faultpoints, point) >= shot, 120, what=f"a worker to reach {point}")


def sent_and_applied(stack: Stack, key: str) -> tuple[int, int]:
    """(``tools/call`` requests carrying ``key`` that the witness saw the write server receive,
    mutations the system of record applied under ``key``): the two independent counts."""
    return stack.witness.count(key=key, server="sor"), stack.effects(key)


def idempotency_record(stack: Stack, key: str) -> store.IdempotencyRecord:
    with stack.conn.cursor() as cur:
        record = store.get_idempotency_txn(cur, key)
    assert record is not None, f"no idempotency record for {key}"
    return record


# --- 1. duplicate delivery with the same idempotency key ---------------------------------------------


@BOTH
def test_duplicate_delivery_with_the_same_idempotency_key(stack: Stack) -> None:
    """Duplicates race the first delivery: the controller publishes the same envelope twice at
    once (two connections), and the broker delivers it three more times, all while the first
    delivery holds the action's lease and its claimed idempotency record (held at
    ``before_send``). refund.issue's tool pays again on every call, so only the lease and the
    record stand between the duplicates and more refunds."""
    env = refund(stack, new_account(stack))
    message = stack.message(env)
    with held(stack, "before_send", env.action_id) as shot:
        publish_concurrently(stack, env, 2)
        wait_held(stack, "before_send", shot)
        # One delivery has claimed the key and is about to send; nothing reached the tool yet.
        record = idempotency_record(stack, env.idempotency_key)
        assert (record.status, record.attempts) == (IdempotencyStatus.in_progress, 1)
        assert sent_and_applied(stack, env.idempotency_key) == (0, 0)
        for _ in range(3):
            stack.deliver(message)
        # Each of the other four deliveries meets the live lease. (Two deliveries that lock at the
        # same instant can each get one of the two locks; the one refused on the target lock
        # backs off and meets the lease on its next delivery, so the count may pass four.)
        wait_for(lambda: stack.events(env.action_id).count("redelivery_ignored") >= 4, 120,
                 what="4 duplicates to meet the live lease")
    row = stack.wait_settled(env.action_id)
    events = stack.events(env.action_id)
    assert (events.count("published"), events.count("republished")) == (1, 1)
    ignored = evidence_of(stack, env.action_id, "redelivery_ignored")
    assert {(e["reason_code"], e["which"], e["idempotency_key"]) for e in ignored} == {
        ("lease_busy", "action", env.idempotency_key)}
    # A duplicate after settlement is suppressed with the recorded result, not executed.
    stack.deliver(message)
    wait_for(lambda: "duplicate_suppressed" in stack.events(env.action_id), 120, what="the late duplicate")
    assert row.outcome == Outcome.completed_verified, stack.settle_report(env.action_id)
    assert len(calls_of(stack, env.action_id)) == 1
    record = idempotency_record(stack, env.idempotency_key)
    assert (record.status, record.attempts) == (IdempotencyStatus.completed, 1)
    assert sent_and_applied(stack, env.idempotency_key) == (1, 1)


def publish_concurrently(stack: Stack, env: Any, n: int) -> None:
    """Publish one envelope from ``n`` controller connections at the same moment."""
    conns = [store.connect(stack.urls["controller"]) for _ in range(n)]
    start = threading.Barrier(n)

    def one(conn: psycopg.Connection) -> dict[str, Any]:
        start.wait(10)
        return publish(stack.settings, conn, stack.app, env)

    try:
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(one, conns))
    finally:
        for conn in conns:
            conn.close()


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
    assert sent_and_applied(stack, other.idempotency_key) == (0, 0)
    assert sent_and_applied(stack, env.idempotency_key) == (1, 1)
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000 - 1000
    assert stack.action(env.action_id).outcome == Outcome.completed_verified
    assert len(calls_of(stack, env.action_id)) == 1


# --- 3. timeout before downstream receipt -------------------------------------------------------


@PROXIED
def test_timeout_before_downstream_receipt(stack: Stack) -> None:
    """The network holds the request back (the proxy's request-direction delay) past the caller's
    timeout, then loses it with its connection: the server never receives it. The caller cannot
    know that: unknown outcome → verification proves the effect absent → retry with the same key
    → exactly one refund."""
    account = new_account(stack)
    env = refund(stack, account, timeout_seconds=1.0)
    try:
        with held(stack, "before_send", env.action_id) as shot:
            stack.publish(env)
            wait_held(stack, "before_send", shot)  # revalidated and claimed; the request is next
            stack.proxy.set_mode("delay", seconds=600, direction="request")
        stack.wait_event(env.action_id, "tool_called")
        # Timed out with the request still held in the network: nothing reached the server.
        assert sent_and_applied(stack, env.idempotency_key) == (0, 0)
        held_bytes = stack.proxy.stats()["bytes_client_to_server"]
        stack.proxy.set_mode("reset")  # the held request is lost with its connection
        assert stack.proxy.stats()["bytes_client_to_server"] == held_bytes
    finally:
        stack.proxy.set_mode("pass")
    row = stack.wait_settled(env.action_id, timeout=60)
    calls = calls_of(stack, env.action_id)
    assert (calls[0]["outcome"], calls[0]["reason_code"]) == (Outcome.unknown_outcome.value, "response_lost")
    decided = evidence_of(stack, env.action_id, "recovery_decided")
    assert decided[0]["decision"] == "retry" and decided[0]["facts"]["finding"] == "absent"
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert len(calls) == 2 and calls[1]["outcome"] == Outcome.completed_unverified.value
    assert idempotency_record(stack, env.idempotency_key).attempts == 2
    # The runtime sent two requests; the server received only the retry, and applied it once.
    assert sent_and_applied(stack, env.idempotency_key) == (1, 1)
    [received] = stack.witness.calls(key=env.idempotency_key, server="sor")
    assert received.fencing_token == idempotency_record(stack, env.idempotency_key).fencing_token
    assert len(sor.find_refund_by_key(stack.sor_db, env.idempotency_key)["refunds"]) == 1


# --- 4. timeout after downstream receipt --------------------------------------------------------


@PROXIED
def test_timeout_after_downstream_receipt(stack: Stack) -> None:
    """The request reaches the server, which applies it; the network then black-holes the
    response. Unknown outcome → verified through the independent read path, never re-sent."""
    account = new_account(stack)
    env = refund(stack, account, timeout_seconds=2.0)
    try:
        with held(stack, "before_send", env.action_id) as shot:
            stack.publish(env)
            wait_held(stack, "before_send", shot)
            stack.proxy.set_mode("blackhole", forward_close=False)
        stack.wait_event(env.action_id, "tool_called")
        assert stack.proxy.stats()["responses_dropped"] >= 1
    finally:
        stack.proxy.set_mode("pass")
    assert calls_of(stack, env.action_id)[0]["outcome"] == Outcome.unknown_outcome.value
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert len(calls_of(stack, env.action_id)) == 1
    assert sent_and_applied(stack, env.idempotency_key) == (1, 1)
    # The server did answer, with success: the answer is what the network lost.
    [received] = stack.witness.calls(key=env.idempotency_key, server="sor")
    assert received.answered and received.is_error is False


# --- 5. lost response after successful mutation ------------------------------------------------------


@ALL_PROTOCOLS
def test_lost_response_after_successful_mutation(stack: Stack) -> None:
    """The seed's most important test: the downstream applies the write and the response is lost;
    the broker redelivers the same envelope (same key) while the first worker has recorded the
    unknown outcome and not yet handed it to verification. The redelivery re-sends nothing: it
    drives verification, which proves exactly one side effect and recovers the original result."""
    account = new_account(stack)
    env = refund(stack, account, timeout_seconds=1.0)
    sor.set_fault(stack.sor_db, "issue_refund", "drop_response", remaining=1, delay_seconds=30)
    with held(stack, "after_ledger", env.action_id) as shot:
        stack.publish(env)
        wait_held(stack, "after_ledger", shot)
        assert calls_of(stack, env.action_id)[0]["outcome"] == Outcome.unknown_outcome.value
        assert stack.action(env.action_id).status == ActionStatus.verifying
        stack.deliver(stack.message(env))  # the broker's redelivery of the same envelope
        stack.wait_event(env.action_id, "redelivery_reenqueued_verification")
        row = stack.wait_settled(env.action_id)  # settled by the verification the redelivery drove
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert stack.events(env.action_id).count("redelivery_reenqueued_verification") == 1
    assert len(calls_of(stack, env.action_id)) == 1
    assert sent_and_applied(stack, env.idempotency_key) == (1, 1)
    refunds = sor.find_refund_by_key(stack.sor_db, env.idempotency_key)["refunds"]
    assert len(refunds) == 1
    # The original result (the refund's id) is recovered from the system of record.
    assert row.result["recovered_by"] == "verification"
    assert row.result["values"]["refund"]["id"] == refunds[0]["id"]
    assert idempotency_record(stack, env.idempotency_key).status == IdempotencyStatus.completed


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
    assert calls_of(stack, env.action_id) == []
    assert sent_and_applied(stack, env.idempotency_key) == (0, 0)
    assert sor.get_ticket(stack.sor_db, ticket)["ticket"]["status"] == "open"


# --- 7. expired approval -----------------------------------------------------------------------------


def test_expired_approval(stack: Stack) -> None:
    env = refund(stack, new_account(stack), approval_ttl=timedelta(seconds=-1))
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "approval_expired")
    assert calls_of(stack, env.action_id) == []
    assert sent_and_applied(stack, env.idempotency_key) == (0, 0)


# --- 8. revoked workload identity --------------------------------------------------------------------


def test_revoked_workload_identity(stack: Stack) -> None:
    identity = f"agent:rogue-{time.monotonic_ns()}"
    env = refund(stack, new_account(stack), workload_identity=identity)
    with store.transaction(stack.operator) as cur:
        store.revoke_identity_txn(cur, identity, "secops@example.com", "credential leaked")
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "identity_revoked")
    assert calls_of(stack, env.action_id) == []
    assert sent_and_applied(stack, env.idempotency_key) == (0, 0)


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
    failed = evidence_of(stack, env.action_id, "revalidation_failed")[0]
    assert env.tool.contract_hash in failed["detail"]
    assert calls_of(stack, env.action_id) == []
    assert sent_and_applied(stack, env.idempotency_key) == (0, 0)
    # With the approved schema back, a fresh approval of the same intent executes.
    again = ticket_env(stack)
    stack.publish(again)
    assert stack.wait_settled(again.action_id).outcome == Outcome.completed_verified
    assert sent_and_applied(stack, again.idempotency_key) == (1, 1)


# --- 10. concurrent action against the same target ------------------------------------------------


def test_concurrent_action_against_the_same_target(stack: Stack) -> None:
    """Two different actions, both approved against the same account version, arrive together.
    The first holds the target's lock (held at ``before_send``) when the second arrives; the
    target lock serialises them; the second then sees the version the first produced and does
    not start: it is never adapted to the new state."""
    account = new_account(stack)
    first = refund(stack, account, amount=1000)
    second = refund(stack, account, amount=2000)
    with held(stack, "before_send", first.action_id) as shot:
        stack.publish(first)
        wait_held(stack, "before_send", shot)
        stack.publish(second)
        stack.wait_event(second.action_id, "target_busy")
    rows = {e.action_id: stack.wait_settled(e.action_id, timeout=60) for e in (first, second)}
    assert rows[first.action_id].outcome == Outcome.completed_verified
    assert (rows[second.action_id].outcome, rows[second.action_id].reason_code) == (Outcome.not_started,
                                                                                    "stale_version")
    assert calls_of(stack, second.action_id) == []
    assert sent_and_applied(stack, first.idempotency_key) == (1, 1)
    assert sent_and_applied(stack, second.idempotency_key) == (0, 0)
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000 - 1000


# --- 11. task record expiration -----------------------------------------------------------------


def test_task_record_expiration(stack: Stack) -> None:
    """An asynchronous restart is accepted with an operation id; the server keeps that operation's
    status record for a time to live of its own (one second here). The runtime is held after
    recording the acceptance until the server has really expired the record. Verification then
    finds the record gone, records that as evidence (``operation_record_expired``), and still
    settles the outcome from the authoritative read of the service."""
    env = restart_env(stack)
    sor.set_operation_ttl(stack.sor_db, 1.0)
    start = stack.witness.mark()
    try:
        with held(stack, "after_ledger", env.action_id) as shot:
            stack.publish(env)
            wait_held(stack, "after_ledger", shot)
            operation = calls_of(stack, env.action_id)[0]["downstream_operation_id"]
            # The downstream answers for the operation until its time to live passes, then no more.
            wait_for(lambda: not sor.get_operation(stack.sor_db, operation)["found"], 90,
                     what=f"the server to expire the record of {operation}")
        row = stack.wait_settled(env.action_id)
    finally:
        sor.clear_faults(stack.sor_db, sor.OPERATION_TTL)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    [expired] = evidence_of(stack, env.action_id, "operation_record_expired")
    assert expired["reason_code"] == "operation_record_expired"
    assert expired["arguments"] == {"operation_id": operation} and expired["record"]["found"] is False
    assert expired["record"]["expired_at"] is not None
    [finished] = evidence_of(stack, env.action_id, "verification_finished")
    assert finished["operation_record"]["retrieved"] is False and finished["finding"] == "expected"
    assert finished["read_tool"] == "get_service"
    assert len(calls_of(stack, env.action_id)) == 1
    assert sent_and_applied(stack, env.idempotency_key) == (1, 1)
    # The runtime did ask the read identity for the operation, after the record had expired.
    asked = stack.witness.calls(tool="get_operation", server="sor:read", since=start)
    assert len(asked) == 1 and asked[0].answered and asked[0].is_error is False


# --- 12. ignored cancellation ------------------------------------------------------------------------


def test_ignored_cancellation(stack: Stack) -> None:
    """An operator cancels while the refund call is in flight. The server receives the MCP
    ``notifications/cancelled`` and ignores it: it applies the refund anyway (``ignore_cancel``
    holds the call until the cancel arrives, then commits). The runtime classifies the call by one
    reason, reconciles from the system of record, and compensates (``reconcile_then_compensate``)."""
    account = new_account(stack)
    env = refund_env(stack, account, cancellation="reconcile_then_compensate")
    sor.set_fault(stack.sor_db, "issue_refund", "ignore_cancel", remaining=1, delay_seconds=60)
    stack.publish(env)

    def in_flight() -> bool:  # the server took the fault's shot: the call is inside the tool
        return any(f["tool"] == "issue_refund" and f["remaining"] == 0 for f in sor.list_faults(stack.sor_db))

    wait_for(in_flight, 90, what="the refund call to reach the server")
    assert sent_and_applied(stack, env.idempotency_key) == (1, 0)  # received, nothing applied yet
    result = cancel(stack.operator, CeleryDispatch(stack.app), env.action_id, "ops@example.com", "wrong customer")
    assert result["accepted"] and result["disposition"] == "awaiting external state"
    row = stack.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome) == (ActionStatus.cancelled, Outcome.compensated)
    [called] = calls_of(stack, env.action_id)
    assert (called["outcome"], called["reason_code"]) == (Outcome.unknown_outcome.value, "cancelled_in_flight")
    # The server's own log: it received the cancellation and did not honour it.
    assert [c["disposition"] for c in sor.cancellations(stack.sor_db, env.idempotency_key)] == ["ignored"]
    [received] = stack.witness.calls(key=env.idempotency_key, server="sor")
    assert received.cancelled and [c["via"] for c in stack.witness.cancels(key=env.idempotency_key)] == [
        "notification"]
    # Reconciled from the system of record: one refund happened, and it was reversed once.
    refunds = sor.find_refund_by_key(stack.sor_db, env.idempotency_key)["refunds"]
    assert len(refunds) == 1 and refunds[0]["status"] == "reversed"
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000
    comp = stack.action(recovery_action(stack, env.action_id))
    assert sent_and_applied(stack, env.idempotency_key) == (1, 1)
    assert sent_and_applied(stack, comp.idempotency_key) == (1, 1)


# --- 13. progress notification flood -----------------------------------------------------------------


def test_progress_notification_flood(stack: Stack) -> None:
    """The server floods progress (one notification every 10 ms for a minute) and never answers.
    Each notification restarts the one-second request timeout, so only the absolute deadline,
    twenty seconds out, can end the call: it is cut there, however much progress keeps coming. (Ten
    seconds was too close on a loaded machine: the delivery once started after the deadline, and the
    action closed before any call.)"""
    flood_seconds = 60.0
    env = restart_env(stack, timeout_seconds=1.0, deadline_in=timedelta(seconds=20))
    sor.set_fault(stack.sor_db, "restart_service", "progress_flood", remaining=1, delay_seconds=flood_seconds)
    stack.publish(env)
    row = stack.wait_settled(env.action_id, timeout=60)
    [called] = calls_of(stack, env.action_id)
    assert (called["outcome"], called["reason_code"]) == (Outcome.unknown_outcome.value, "absolute_deadline_reached")
    # Progress kept the call going past the request timeout (each notification restarted it)...
    assert called["elapsed_ms"] > 1000 * env.timeout_seconds
    assert called["progress_total"] > len(called["progress"])
    # ...but the flood was cut at the deadline, and only a bounded sample of it was recorded.
    assert len(called["progress"]) == 5  # PROOFLINE_PROGRESS_EVENTS_LIMIT in the test stack
    [seen] = sor.cancellations(stack.sor_db, env.idempotency_key)
    sent = int(seen["disposition"].split(": ")[1].split()[0])
    assert seen["disposition"].startswith("honoured") and called["progress_total"] <= sent < flood_seconds * 100
    # Nothing was applied, verification proved it, and no retry runs past the deadline.
    assert row.finding == "absent" and row.outcome == Outcome.failed_before_side_effect
    [decided] = evidence_of(stack, env.action_id, "recovery_decided")
    assert (decided["decision"], decided["reason"]) == ("manual_intervention", "retries_exhausted")
    assert decided["facts"]["seconds_left"] < decided["facts"]["retry_cost_seconds"]
    assert row.status == ActionStatus.escalated
    assert sent_and_applied(stack, env.idempotency_key) == (1, 0)
    [received] = stack.witness.calls(key=env.idempotency_key, server="sor")
    assert received.cancelled and not received.answered and received.progress >= called["progress_total"]


# --- 14. partial multi-step completion ---------------------------------------------------------------


def test_partial_multi_step_completion(stack: Stack) -> None:
    account = new_account(stack)
    steps = run_of(stack, [
        lambda **kw: ticket_env(stack, **kw),
        lambda **kw: refund_env(stack, account, **kw),
        lambda **kw: stale_close_env(stack, **kw),
    ])
    stack.publish_run(steps)
    run_settled(stack, steps[0].run_id, expect="compensated")
    rows = [stack.action(e.action_id) for e in steps]
    assert [r.outcome for r in rows] == [Outcome.compensated, Outcome.compensated, Outcome.not_started]
    assert rows[2].reason_code == "stale_version"
    # Each compensation ran as its own verified action, the later step first.
    comps = [stack.action(recovery_action(stack, e.action_id)) for e in steps[:2]]
    assert all(c.outcome == Outcome.completed_verified for c in comps)
    assert comps[1].published_at < comps[0].published_at
    # Downstream: the refund is reversed and the created ticket closed, each exactly once.
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000
    assert sor.find_refund_by_key(stack.sor_db, steps[1].idempotency_key)["refund"]["status"] == "reversed"
    assert sor.find_ticket_by_key(stack.sor_db, steps[0].idempotency_key)["ticket"]["status"] == "closed"
    for key in (steps[0].idempotency_key, steps[1].idempotency_key, *(c.idempotency_key for c in comps)):
        assert sent_and_applied(stack, key) == (1, 1)
    assert sent_and_applied(stack, steps[2].idempotency_key) == (0, 0)


# --- 15. verification API outage ---------------------------------------------------------------------


def test_verification_api_outage(stack: Stack) -> None:
    account = new_account(stack)
    env = refund_env(stack, account)
    sor.set_read_outage(stack.sor_db, True, role="reader")  # the verification read path is down
    start = stack.witness.mark()
    try:
        stack.publish(env)
        row = stack.wait_settled(env.action_id, timeout=60)
    finally:
        sor.set_read_outage(stack.sor_db, False, role="reader")
    assert (row.status, row.outcome, row.finding) == (ActionStatus.escalated, Outcome.completed_unverified,
                                                       "unavailable")
    [finished] = evidence_of(stack, env.action_id, "verification_finished")
    assert finished["reads"] == 0 and finished["failed_reads"] > 1  # it kept trying to the bound
    reads = stack.witness.calls(tool="find_refund_by_key", server="sor:read", since=start)
    assert len(reads) >= finished["failed_reads"] and all(r.is_error for r in reads)
    assert len(calls_of(stack, env.action_id)) == 1
    assert sent_and_applied(stack, env.idempotency_key) == (1, 1)  # never a second write to "make sure"


# --- 16. eventual consistency delay ------------------------------------------------------------------


def test_eventual_consistency_delay(stack: Stack) -> None:
    """The verification read path is a replica that lags the writer: it stops replicating just
    before the restart, and catches up only once the test has seen verification read it (through
    the witness). service.restart's contract declares a consistency delay of 3 s. The stale read
    shows the service untouched, which is exactly what the contract's "absent" condition
    describes: read within the declared delay it is no evidence of absence, so verification keeps
    reading until the restart shows, and the single restart is verified instead of retried."""
    contract = contract_for(stack.settings.contracts_dir, "service.restart")
    env = restart_env(stack)
    stopped_at = time.time()
    sor.set_replica_position(stack.sor_db, stopped_at, role="reader")
    start = stack.witness.mark()
    try:
        stack.publish(env)

        def stale_reads() -> int:  # verification's reads (the write identity does the precondition read)
            return len([c for c in stack.witness.calls(tool="get_service", server="sor:read", since=start)
                        if c.answered])

        wait_for(stale_reads, 90, what="verification to read the lagging replica")
    finally:
        sor.set_replica_position(stack.sor_db, None, role="reader")  # replication catches up
    row = stack.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    # What the replica showed is what "absent" means: a verifier that did not wait would conclude it.
    stale = sor.get_service(stack.sor_db, env.target.id, as_of=stopped_at)
    doc = env.model_dump(mode="json")
    assert holds(contract.verification.absent, {"after": stale, "target": doc["target"], "args": doc["arguments"]})
    assert "recovery_decided" not in stack.events(env.action_id)
    [finished] = evidence_of(stack, env.action_id, "verification_finished")
    findings = [t["finding"] for t in finished["timeline"]]
    assert findings[0] == "not_reached" and "absent" not in findings and findings[-1] == "expected"
    called = calls_of(stack, env.action_id)
    assert len(called) == 1 and called[0]["outcome"] == Outcome.accepted.value
    assert sent_and_applied(stack, env.idempotency_key) == (1, 1)
    assert stack.witness.count(tool="get_service", server="sor:read", since=start) >= finished["reads"] > 1


# --- 17. compensation retry --------------------------------------------------------------------------


def test_compensation_retry(stack: Stack) -> None:
    """Step 1 of a run cannot start, so step 0 (a created ticket) is compensated by closing it. The
    first compensation call fails transiently before committing; the compensation is retried with
    its same key and succeeds: two calls, one effect, the ticket closed once."""
    steps = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: stale_close_env(stack, **kw)])
    sor.set_fault(stack.sor_db, "close_ticket", "fail_before_commit", remaining=1)
    stack.publish_run(steps)
    run_settled(stack, steps[0].run_id, expect="compensated")
    comp_id = recovery_action(stack, steps[0].action_id)
    comp = stack.action(comp_id)
    assert comp.outcome == Outcome.completed_verified
    first, second = calls_of(stack, comp_id)
    assert (first["outcome"], first["reason_code"]) == (Outcome.failed_before_side_effect.value,
                                                        "tool_error:failed_before_side_effect")
    assert second["outcome"] == Outcome.completed_unverified.value
    assert [e["attempts"] for e in evidence_of(stack, comp_id, "retry_scheduled")] == [1]
    assert idempotency_record(stack, comp.idempotency_key).attempts == 2
    # Two requests with the same key reached the server: the first refused, the second applied.
    assert sent_and_applied(stack, comp.idempotency_key) == (2, 1)
    assert [c.is_error for c in stack.witness.calls(key=comp.idempotency_key, server="sor")] == [True, False]
    assert sor.find_ticket_by_key(stack.sor_db, steps[0].idempotency_key)["ticket"]["status"] == "closed"
    assert stack.action(steps[0].action_id).outcome == Outcome.compensated


# --- 18. compensation failure ------------------------------------------------------------------------


def test_compensation_failure(stack: Stack) -> None:
    steps = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: stale_close_env(stack, **kw)])
    # Every compensation call fails before committing: the retries run out.
    sor.set_fault(stack.sor_db, "close_ticket", "fail_before_commit", remaining=-1)
    blocked = None
    try:
        stack.publish_run(steps)
        parent = wait_for(lambda: (r := stack.action(steps[0].action_id)) and r.status == ActionStatus.escalated
                          and r, 60, what="compensation_failed")
    finally:
        sor.clear_faults(stack.sor_db)
    try:
        assert parent.outcome == Outcome.compensation_failed
        assert "compensation_failed" in stack.events(steps[0].action_id)
        comp = stack.action(recovery_action(stack, steps[0].action_id))
        attempts = calls_of(stack, comp.action_id)
        assert len(attempts) == 2 and all(c["outcome"] == Outcome.failed_before_side_effect.value for c in attempts)
        assert sent_and_applied(stack, comp.idempotency_key) == (2, 0)
        switches = {(s["scope"], s["value"]) for s in list_switches(stack.conn)}
        assert ("tool_tenant", "sor:create_ticket@acme") in switches  # this server's tool only
        # The ticket is still open: the failed compensation applied nothing.
        assert sor.find_ticket_by_key(stack.sor_db, steps[0].idempotency_key)["ticket"]["status"] == "open"
        # Automation is blocked for that tool and tenant: a new action does not start.
        blocked = ticket_env(stack)
        stack.publish(blocked)
        row = stack.wait_settled(blocked.action_id)
        assert (row.outcome, row.reason_code) == (Outcome.not_started, "kill_switch_engaged")
        assert calls_of(stack, blocked.action_id) == []
        assert sent_and_applied(stack, blocked.idempotency_key) == (0, 0)
        # It is in the manual queue with its evidence, and an operator can resolve it.
        queued = {r["action_id"]: r for r in manual_queue(stack.conn)}
        assert steps[0].action_id in queued
        assert any(e["event"] == "compensation_failed" for e in queued[steps[0].action_id]["evidence"])
        resolve(stack.operator, steps[0].action_id, "compensated", "oncall@example.com", "closed by hand",
                {"ticket": "closed in the UI"})
        assert stack.action(steps[0].action_id).reason_code == "operator_compensated"
        assert "operator_intervention" in stack.events(steps[0].action_id)
    finally:
        clear_switch(stack.operator, KillSwitchScope.tool_tenant, "sor:create_ticket@acme", "oncall@example.com",
                     "resolved")


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
    assert all(calls_of(stack, e.action_id) == [] for e in envs)
    assert [sent_and_applied(stack, e.idempotency_key) for e in envs] == [(0, 0)] * 3
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000
    # The tool-only form means that tool on every server: recorded as such.
    events = [e["event"] for e in stack.timeline("killswitch:tool:*:issue_refund")]
    assert events[-2:] == ["kill_switch_set", "kill_switch_cleared"]


# --- 20. forensic reconstruction from evidence -------------------------------------------------------


def forensics_document(stack: Stack, action_id: str) -> dict[str, Any]:
    """``proofline forensics --json`` as an operator runs it (the reader role), parsed."""
    env = dict(os.environ, PROOFLINE_DATABASE_URL=stack.database_url,
               PROOFLINE_READER_DATABASE_URL=stack.urls["reader"], PYTHONPATH=str(ROOT))
    out = zygote.run([sys.executable, "-m", "proofline", "forensics", "--json", action_id], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_forensic_reconstruction_from_evidence(stack: Stack) -> None:
    """A compensated run is reconstructed from the ledger alone; then the table owner rewrites one
    recorded fact (the verification's finding) behind the insert-only trigger, and the report's
    own chain check names the broken link, while the compensation's chain stays intact."""
    steps = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: stale_close_env(stack, **kw)])
    stack.publish_run(steps)
    run_settled(stack, steps[0].run_id)
    aid = steps[0].action_id
    comp = recovery_action(stack, aid)
    doc = forensics_document(stack, aid)
    assert doc["chain"] == {"intact": True, "events": len(stack.events(aid)), "broken_at_seq": None, "problem": None}
    authorized = doc["authorized"]["evidence"]
    assert (authorized["requester"], authorized["workload_identity"]) == (steps[0].requester,
                                                                         steps[0].workload_identity)
    assert authorized["approval"]["id"] == steps[0].approval.id
    assert [e["evidence"]["outcome"] for e in doc["executed"]] == [Outcome.completed_unverified.value]
    [verified] = [e for e in doc["changed"] if e["event"] == "verification_finished"]
    assert verified["evidence"]["finding"] == "expected"
    decided = [e for e in doc["recovery"] if e["event"] == "recovery_decided"]
    assert [(d["evidence"]["decision"], d["evidence"]["reason"]) for d in decided] == [("compensation",
                                                                                        "run_step_failed")]
    [published] = [e for e in doc["recovery"] if e["event"] == "recovery_action_published"]
    assert published["action"]["action_id"] == comp and published["action"]["chain"]["intact"] is True
    assert published["action"]["executed"][0]["evidence"]["outcome"] == Outcome.completed_unverified.value
    assert [(e["event"], e["evidence"].get("recovery_action")) for e in doc["final"]] == [
        ("final_state", None), ("compensated", comp)]
    # What the report says executed is what the witness and the system of record saw.
    assert sent_and_applied(stack, steps[0].idempotency_key) == (1, 1)
    assert sent_and_applied(stack, stack.action(comp).idempotency_key) == (1, 1)
    assert sent_and_applied(stack, steps[1].idempotency_key) == (0, 0)

    # The owner rewrites history: the verification "found" a prohibited state instead.
    seq = verified["seq"]
    with psycopg.connect(stack.admin_url, autocommit=True) as admin:
        original = admin.execute("SELECT evidence FROM ledger_events WHERE action_id = %s AND seq = %s",
                                 (aid, seq)).fetchone()[0]
        edit = "UPDATE ledger_events SET evidence = %s WHERE action_id = %s AND seq = %s"
        try:
            with admin.transaction():
                admin.execute("ALTER TABLE ledger_events DISABLE TRIGGER ledger_events_no_update")
                admin.execute(edit, (json.dumps({**original, "finding": "prohibited"}), aid, seq))
                admin.execute("ALTER TABLE ledger_events ENABLE TRIGGER ledger_events_no_update")
            tampered = forensics_document(stack, aid)
        finally:  # put the record back: the shared stack's other tests check every chain
            with admin.transaction():
                admin.execute("ALTER TABLE ledger_events DISABLE TRIGGER ledger_events_no_update")
                admin.execute(edit, (json.dumps(original), aid, seq))
                admin.execute("ALTER TABLE ledger_events ENABLE TRIGGER ledger_events_no_update")
    assert tampered["chain"]["intact"] is False
    assert tampered["chain"]["broken_at_seq"] == seq
    assert tampered["chain"]["problem"] == "content does not match its hash (the event was altered)"
    [shown] = [e for e in tampered["changed"] if e["event"] == "verification_finished"]
    assert shown["evidence"]["finding"] == "prohibited"  # the report shows what is stored, flagged by the check
    [nested] = [e["action"] for e in tampered["recovery"] if e["event"] == "recovery_action_published"]
    assert nested["chain"]["intact"] is True  # the compensation's own chain
    assert forensics_document(stack, aid)["chain"]["intact"] is True  # restored
