"""Issue 3: recovery on the real stack. Each test injects its situation for real and checks both
the ledger and the system of record's own effects log."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from ledger import store
from ledger.states import ActionStatus, KillSwitchScope, Outcome
from proofline.controller import publish_message
from proofline.envelope import Envelope
from proofline.settings import ROOT
from proofline.sor import store as sor
from recovery.cancel import cancel
from recovery.operator import clear_switch, list_switches, set_switch
from tests.conftest import Stack, wait_for
from worker.dispatch import CeleryDispatch


def uid() -> str:
    return str(time.monotonic_ns())


def ticket_env(stack: Stack, **kw: Any) -> Envelope:
    return stack.envelope("ticket.create", arguments={"tenant": "acme", "title": f"t-{uid()}", "owner": "ops"},
                          target={"type": "ticket_queue", "id": "acme-ops"}, **kw)


def new_account(stack: Stack, balance: int = 100_000) -> str:
    name = f"acct-{uid()}"
    sor.put_account(stack.sor_db, name, "acme", balance)
    return name


def refund_env(stack: Stack, account: str, amount: int = 1200, **kw: Any) -> Envelope:
    version = sor.get_account(stack.sor_db, account)["account"]["version"]
    return stack.envelope("refund.issue",
                          arguments={"account": account, "tenant": "acme", "amount_cents": amount, "reason": "sla"},
                          target={"type": "account", "id": account, "expected_version": version}, **kw)


def stale_close_env(stack: Stack, **kw: Any) -> Envelope:
    ticket = sor.put_ticket(stack.sor_db, "acme", "to close", "ops")
    version = sor.get_ticket(stack.sor_db, ticket)["ticket"]["version"]
    env = stack.envelope("ticket.close", arguments={"ticket_id": ticket, "expected_version": version},
                         target={"type": "ticket", "id": ticket, "expected_version": version}, **kw)
    sor.bump_version(stack.sor_db, "ticket", ticket)  # changed after approval: this step cannot start
    return env


def run_of(stack: Stack, builders: list) -> list[Envelope]:
    run_id, n = f"run-{uid()}", len(builders)
    return [build(run_id=run_id, action_id=f"{run_id}-s{i}", step=i, run_steps=n) for i, build in enumerate(builders)]


def recovery_action(stack: Stack, action_id: str) -> str:
    published = [e for e in stack.timeline(action_id) if e["event"] == "recovery_action_published"]
    assert published, f"no recovery action for {action_id}: {stack.events(action_id)}"
    return published[0]["evidence"]["recovery_action"]


def key_of(stack: Stack, action_id: str) -> str:
    return stack.action(action_id).idempotency_key


def run_settled(stack: Stack, run_id: str) -> dict[str, Any]:
    def settled():
        events = [e for e in stack.timeline(f"run:{run_id}") if e["event"] == "run_settled"]
        return events[0]["evidence"] if events else None

    return wait_for(settled, 60, what=f"run {run_id} to settle")


def test_partial_multi_step_run_is_compensated_in_reverse_order(stack: Stack) -> None:
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


def test_compensation_whose_first_attempt_is_lost_applies_exactly_once(stack: Stack) -> None:
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


def test_compensation_failure_blocks_automation_for_tool_and_tenant(stack: Stack) -> None:
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
    from recovery.operator import manual_queue, resolve

    queued = {r["action_id"]: r for r in manual_queue(stack.conn)}
    assert steps[0].action_id in queued
    assert any(e["event"] == "compensation_failed" for e in queued[steps[0].action_id]["evidence"])
    resolve(stack.conn, steps[0].action_id, "compensated", "oncall@example.com", "closed by hand",
            {"ticket": "closed in the UI"})
    assert stack.action(steps[0].action_id).reason_code == "operator_compensated"
    assert "operator_intervention" in stack.events(steps[0].action_id)
    clear_switch(stack.conn, KillSwitchScope.tool_tenant, "create_ticket@acme", "oncall@example.com", "resolved")


def test_ignored_cancellation_is_reconciled_and_compensated(stack: Stack) -> None:
    account = new_account(stack)
    env = refund_env(stack, account, cancellation="reconcile_then_compensate")
    # The server applies the refund and then keeps the request open: a cancellation cannot stop it.
    sor.set_fault(stack.sor_db, "issue_refund", "drop_response", remaining=1, delay_seconds=3)
    stack.publish(env)
    stack.wait_event(env.action_id, "preconditions_passed")
    wait_for(lambda: stack.effects(env.idempotency_key) == 1, 20, what="the refund to be applied")
    result = cancel(stack.conn, CeleryDispatch(stack.app), env.action_id, "ops@example.com", "wrong customer")
    assert result["accepted"] and result["disposition"] == "awaiting external state"
    row = stack.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome) == (ActionStatus.cancelled, Outcome.compensated)
    called = next(e for e in stack.timeline(env.action_id) if e["event"] == "tool_called")["evidence"]
    assert called["reason_code"] in ("cancelled_in_flight", "response_lost")
    # Reconciled from the system of record: one refund happened, and it was reversed once.
    refund = sor.find_refund_by_key(stack.sor_db, env.idempotency_key)["refunds"]
    assert len(refund) == 1 and refund[0]["status"] == "reversed"
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000


def test_cancelling_a_queued_step_cancels_it_and_unwinds_the_run(stack: Stack) -> None:
    steps = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: ticket_env(stack, **kw)])
    sor.set_fault(stack.sor_db, "create_ticket", "delay", remaining=1, delay_seconds=1.5)
    stack.publish_run(steps)
    result = cancel(stack.conn, CeleryDispatch(stack.app), steps[1].action_id, "ops@example.com", "not needed")
    assert result["disposition"] == "cancelled"
    row = stack.action(steps[1].action_id)
    assert (row.status, row.outcome) == (ActionStatus.cancelled, Outcome.not_started)
    # The run cannot complete any more: the step that did run is compensated once verified.
    assert run_settled(stack, steps[0].run_id)["outcome"] == "compensated"
    assert stack.action(steps[0].action_id).outcome == Outcome.compensated
    assert sor.find_ticket_by_key(stack.sor_db, steps[0].idempotency_key)["ticket"]["status"] == "closed"
    assert stack.effects(steps[1].idempotency_key) == 0
    assert "tool_called" not in stack.events(steps[1].action_id)


def test_verification_outage_beyond_the_bound_escalates_without_retrying(stack: Stack) -> None:
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


def test_eventual_consistency_within_tolerance_is_verified(stack: Stack) -> None:
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


class _LosingBroker:
    """A dispatcher whose broker loses every message: the ledger records the publication, the
    queue never sees it."""

    def __init__(self) -> None:
        self.lost: list[dict[str, Any]] = []

    def execute(self, message: dict[str, Any], queue: str = "actions", task_id: str | None = None) -> str:
        self.lost.append(message)
        return task_id or ""


def test_lost_broker_message_is_redriven_by_the_reconciler(stack: Stack) -> None:
    env = refund_env(stack, new_account(stack))
    broker = _LosingBroker()
    publish_message(stack.conn, broker, stack.message(env), env)
    assert len(broker.lost) == 1
    row = stack.wait_settled(env.action_id, timeout=60)
    assert row.outcome == Outcome.completed_verified
    redriven = [e for e in stack.timeline(env.action_id) if e["event"] == "redriven"]
    assert redriven and redriven[0]["evidence"]["reason"] == "not_started"
    assert stack.effects(env.idempotency_key) == 1


def test_kill_switch_set_while_actions_are_queued_stops_them_all(stack: Stack) -> None:
    account = new_account(stack)
    envs = [refund_env(stack, account, amount=100 + n) for n in range(3)]
    broker = _LosingBroker()
    for env in envs:
        publish_message(stack.conn, broker, stack.message(env), env)
    set_switch(stack.conn, KillSwitchScope.tool, "issue_refund", "secops@example.com", "refund fraud suspected")
    try:
        for message in broker.lost:  # the queued messages now reach the workers
            stack.deliver(message)
        rows = [stack.wait_settled(e.action_id) for e in envs]
    finally:
        clear_switch(stack.conn, KillSwitchScope.tool, "issue_refund", "secops@example.com", "cleared")
    assert all((r.outcome, r.reason_code) == (Outcome.not_started, "kill_switch_engaged") for r in rows)
    assert all(stack.effects(e.idempotency_key) == 0 for e in envs)
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 100_000
    events = [e for e in stack.timeline("killswitch:tool:issue_refund")]
    assert [e["event"] for e in events][-2:] == ["kill_switch_set", "kill_switch_cleared"]


def test_irreversible_action_needs_its_approval_and_the_last_place(stack: Stack) -> None:
    plain = refund_env(stack, new_account(stack), irreversible=True)
    stack.publish(plain)
    row = stack.wait_settled(plain.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "point_of_no_return_refused")
    assert stack.effects(plain.idempotency_key) == 0
    # With the right approval but not last in its run: refused as well, before any effect.
    steps = run_of(stack, [
        lambda **kw: refund_env(stack, new_account(stack), irreversible=True,
                                approval_extra={"covers_irreversible": True}, **kw),
        lambda **kw: ticket_env(stack, **kw),
    ])
    stack.publish_run(steps)
    first = stack.wait_settled(steps[0].action_id)
    assert (first.outcome, first.reason_code) == (Outcome.not_started, "point_of_no_return_refused")
    assert stack.effects(steps[0].idempotency_key) == 0
    # Last, approved, after a verified step: it executes, and the ledger says compensation is unavailable.
    ok = run_of(stack, [
        lambda **kw: ticket_env(stack, **kw),
        lambda **kw: refund_env(stack, new_account(stack), irreversible=True,
                                approval_extra={"covers_irreversible": True}, **kw),
    ])
    stack.publish_run(ok)
    last = stack.wait_settled(ok[1].action_id, timeout=60)
    assert last.outcome == Outcome.completed_verified
    revalidated = next(e for e in stack.timeline(ok[1].action_id) if e["event"] == "revalidated")["evidence"]
    assert revalidated["point_of_no_return"]["compensation"] == "not available"


def test_forensic_reconstruction_from_the_ledger_alone(stack: Stack) -> None:
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
