"""Issue 2 §7: the core path against real Postgres, Redis, Celery worker processes and the MCP
system of record. Every test checks both the ledger and the downstream store's effects log."""

from __future__ import annotations

import copy
import time
import uuid

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.controller import publish
from proofline_kit.sor import store as sor
from tests.conftest import VERIFY_TASK, Stack, wait_for

BOTH = pytest.mark.parametrize("stack", ["stdio", "http"], indirect=True)
#: Also the older protocol generation (initialize handshake, HTTP sessions): many servers speak only that.
ALL_PROTOCOLS = pytest.mark.parametrize("stack", ["stdio", "http", "http-legacy"], indirect=True)


def refund(stack: Stack, account: str, amount: int = 1500, **kw):
    version = sor.get_account(stack.sor_db, account)["account"]["version"]
    return stack.envelope(
        "refund.issue", arguments={"account": account, "tenant": "acme", "amount_cents": amount, "reason": "outage"},
        target={"type": "account", "id": account, "expected_version": version}, **kw)


def new_account(stack: Stack, balance: int = 100_000) -> str:
    name = f"acct-{time.monotonic_ns()}"
    sor.put_account(stack.sor_db, name, "acme", balance)
    return name


def verified_ticket(stack: Stack):
    """A ticket created on the happy path: verified, one effect."""
    env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": "disk full", "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"})
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome, row.finding) == (ActionStatus.closed, Outcome.completed_verified, "expected")
    assert stack.effects(env.idempotency_key) == 1
    return env


@ALL_PROTOCOLS
def test_happy_path_is_verified_with_one_effect(stack: Stack) -> None:
    env = verified_ticket(stack)
    events = stack.events(env.action_id)
    # The execute task's own read through the read identity proved the post-condition: one commit
    # holds the result and the verdict, and no verification task was sent.
    order = ["published", "validated", "revalidated", "lease_acquired", "idempotency_claimed",
             "preconditions_passed", "tool_called", "verification_finished", "final_state"]
    assert [e for e in events if e in order] == order
    assert "verification_enqueued" not in events
    finished = next(e["evidence"] for e in stack.timeline(env.action_id) if e["event"] == "verification_finished")
    assert finished["in_place"] is True and finished["identity"] == "read" and finished["reads"] == 1
    assert finished["finding"] == "expected" and finished["after"]["ticket"]["title"] == "disk full"
    assert finished["verification_key"] == "verify-" + env.idempotency_key
    assert writing_transactions(stack, env.action_id, "tool_called", "verification_finished") == 1
    # The worker's signed statement of that verdict commits with it, and matches the row.
    assert writing_transactions(stack, env.action_id, "verification_finished", "evidence_signed") == 1
    assert_signed_evidence(stack, env.action_id)


def test_a_wait_that_gives_up_says_where_the_action_stood(stack: Stack) -> None:
    """The suite's own instrument: a wait for an action that never settles fails with the action's
    row and events as they were when it gave up, the broker's queues and the worker logs."""
    env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": "never sent", "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"})
    publish(stack.settings, stack.conn, stack.app, env, hold=True)  # recorded pending, never sent
    with pytest.raises(AssertionError) as failed:
        stack.wait_settled(env.action_id, timeout=0.2)
    report = str(failed.value)
    assert f"{env.action_id} to settle" in report and f"{env.action_id}: pending" in report
    assert "queued: actions=0" in report and "unacked=" in report
    assert "worker-w0.log" in report and "last lines naming" in report


@pytest.mark.parametrize("stack", [VERIFY_TASK], indirect=True)
def test_with_in_place_verification_off_the_verification_task_decides(stack: Stack) -> None:
    env = verified_ticket(stack)
    events = stack.events(env.action_id)
    order = ["published", "validated", "revalidated", "lease_acquired", "idempotency_claimed",
             "preconditions_passed", "tool_called", "verification_enqueued", "verification_finished", "final_state"]
    assert [e for e in events if e in order] == order
    timeline = stack.timeline(env.action_id)
    enqueued = next(e for e in timeline if e["event"] == "verification_enqueued")
    finished = next(e for e in timeline if e["event"] == "verification_finished")
    assert "first_read" not in enqueued["evidence"] and "in_place" not in finished["evidence"]
    assert writing_transactions(stack, env.action_id, "tool_called", "verification_finished") == 2
    assert writing_transactions(stack, env.action_id, "verification_finished", "evidence_signed") == 1
    assert_signed_evidence(stack, env.action_id)


def assert_signed_evidence(stack: Stack, action_id: str) -> None:
    """One ``evidence_signed`` event, by an active worker key, equal to the closed row."""
    from ledger import evidence
    from proofline.keys import KeyRole, load_keyring

    with stack.conn.cursor() as cur:
        key_id = evidence.check_txn(cur, stack.action(action_id), load_keyring(stack.settings.keyring_file),
                                    (ActionStatus.closed,))
    assert load_keyring(stack.settings.keyring_file).get(key_id).role == KeyRole.worker
    assert stack.events(action_id).count("evidence_signed") == 1


def writing_transactions(stack: Stack, action_id: str, *events: str) -> int:
    """How many transactions wrote these events of the action (their rows' ``xmin``)."""
    with stack.conn.cursor() as cur:
        cur.execute("SELECT count(DISTINCT xmin::text) AS n FROM ledger_events WHERE action_id = %s AND event = ANY(%s)",
                    (action_id, list(events)))
        return cur.fetchone()["n"]


def test_same_envelope_to_two_worker_processes_at_once_executes_once(stack: Stack) -> None:
    env = refund(stack, new_account(stack))
    # The tool takes a while, so both deliveries are in flight at the same moment.
    sor.set_fault(stack.sor_db, "issue_refund", "delay", remaining=1, delay_seconds=1.5)
    stack.publish(env)
    stack.deliver(stack.message(env))
    row = stack.wait_settled(env.action_id)
    wait_for(lambda: "redelivery_ignored" in stack.events(env.action_id)
             or "duplicate_suppressed" in stack.events(env.action_id), 20, what="the second delivery's record")
    assert row.outcome == Outcome.completed_verified
    assert stack.effects(env.idempotency_key) == 1
    assert stack.events(env.action_id).count("tool_called") == 1


def test_changed_tool_contract_is_not_started(stack: Stack) -> None:
    version, hashes = stack.live()
    approved = dict(hashes, issue_refund="ab" * 32)  # the approver saw a different schema
    env = refund(stack, new_account(stack), live=(version, approved))
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "tool_contract_changed")
    assert stack.effects(env.idempotency_key) == 0


def test_changed_server_version_is_not_started(stack: Stack) -> None:
    _, hashes = stack.live()
    env = refund(stack, new_account(stack), live=("0.9.0", hashes))
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "server_version_changed")
    assert stack.effects(env.idempotency_key) == 0


def test_tampered_and_unsigned_envelopes_are_refused_and_recorded(stack: Stack) -> None:
    account = new_account(stack)
    env = refund(stack, account)
    tampered = copy.deepcopy(stack.message(env))
    tampered["envelope"]["arguments"]["amount_cents"] = 99_000
    unsigned = {"envelope": stack.message(env)["envelope"]}
    unknown_key = dict(stack.message(env), key_id="nobody")
    before = len(stack.refusals())
    for bad in (tampered, unsigned, unknown_key, "not even an object", {"envelope": {"action_id": 1}}):
        stack.deliver(bad)
    wait_for(lambda: len(stack.refusals()) >= before + 5, 30, what="5 refusals")
    codes = [r["evidence"]["reason_code"] for r in stack.refusals()[before:]]
    assert sorted(codes) == sorted(["envelope_bad_signature", "envelope_unsigned", "envelope_unknown_key",
                                    "envelope_malformed", "envelope_unsigned"])
    # The forged message never touched the real action's chain, and nothing was paid.
    assert stack.action(env.action_id) is None
    assert stack.effects(env.idempotency_key) == 0
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000
    # The workers are still serving good envelopes.
    assert stack.workers_alive()
    stack.publish(env)
    assert stack.wait_settled(env.action_id).outcome == Outcome.completed_verified




def test_correctly_signed_message_nobody_published_is_refused(stack: Stack) -> None:
    """Workers never create actions: a validly signed envelope that no controller recorded (a replay
    from another deployment, a message injected onto the queue) is refused on its own chain."""
    from worker.validate import refusal_chain_id

    account = new_account(stack)
    env = refund(stack, account)
    message = stack.message(env)
    stack.deliver(message)
    chain = refusal_chain_id(message)
    wait_for(lambda: any(r["action_id"] == chain for r in stack.refusals()), 30, what="the refusal")
    (refusal,) = [r for r in stack.refusals() if r["action_id"] == chain]
    assert refusal["evidence"]["reason_code"] == "action_not_published"
    assert refusal["evidence"]["claimed"]["action_id"] == env.action_id
    assert stack.action(env.action_id) is None and stack.events(env.action_id) == []
    assert stack.effects(env.idempotency_key) == 0
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000
    # Published afterwards by the controller, the same envelope runs normally.
    stack.publish(env)
    assert stack.wait_settled(env.action_id).outcome == Outcome.completed_verified
    assert stack.effects(env.idempotency_key) == 1


def test_a_first_read_that_proves_nothing_hands_the_verdict_to_the_verification_task(stack: Stack) -> None:
    """The read identity is down when the execute task reads in place: that read decides nothing,
    the result commits alone with what the read found, and the verification task, polling, settles
    the action once the read path is back."""
    from proofline_kit.sor import store as sor

    env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": f"t-{uuid.uuid4().hex}", "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"})
    sor.set_read_outage(stack.sor_db, True, role="reader")
    try:
        stack.publish(env)
        stack.wait_event(env.action_id, "verification_enqueued")
        assert stack.action(env.action_id).status == ActionStatus.verifying
    finally:
        sor.set_read_outage(stack.sor_db, False, role="reader")
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome, row.finding) == (ActionStatus.closed, Outcome.completed_verified, "expected")
    timeline = stack.timeline(env.action_id)
    [enqueued] = [e["evidence"] for e in timeline if e["event"] == "verification_enqueued"]
    [finished] = [e["evidence"] for e in timeline if e["event"] == "verification_finished"]
    assert enqueued["first_read"] == "unavailable"
    assert "in_place" not in finished and finished["finding"] == "expected"
    assert writing_transactions(stack, env.action_id, "tool_called", "verification_finished") == 2
    assert writing_transactions(stack, env.action_id, "verification_finished", "evidence_signed") == 1
    assert_signed_evidence(stack, env.action_id)
    assert stack.effects(env.idempotency_key) == 1
