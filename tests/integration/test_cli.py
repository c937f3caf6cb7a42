"""The operator's command line against a running stack. Each test checks what the command did to
the deployment (the ledger, the system of record, the witness's count of tool calls), not what it
printed: publish executes once, status reports what the ledger holds, verify-ledger fails on a
tampered chain and names the link, a kill switch stops the next action of its scope before any
call and clearing it lets the next one run, reconcile re-drives a message the broker lost.

The module runs its own stack without Celery beat, so the reconciler runs only when the command
line runs it, and a kill switch or a tampered event here cannot reach another module's tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from ledger import store
from ledger.states import Outcome
from proofline.controller import publish_message
from proofline.settings import ROOT
from proofline_kit import zygote
from tests.conftest import Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import LosingBroker, new_account, refund_env, ticket_env


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = build_stack("stdio", tmp_path_factory.mktemp("stack-cli"))
    try:
        start_workers(s, beat=False)
        yield s
    finally:
        teardown_stack(s)


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")}
    env.update({k: v for k, v in stack.env.items() if k.startswith(("PROOFLINE_", "SOR_"))})
    env["PYTHONPATH"] = str(ROOT)
    return zygote.run([sys.executable, "-m", "proofline", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def ok(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_publish_executes_once_and_status_reports_the_ledger(stack: Stack) -> None:
    action_id = f"cli-{uuid.uuid4().hex[:10]}"
    arguments = {"tenant": "acme", "title": "from the cli", "owner": "ops"}
    ok(cli(stack, "publish", "--action-type", "ticket.create", "--tenant", "acme",
           "--target", json.dumps({"type": "ticket_queue", "id": "acme-ops"}),
           "--args", json.dumps(arguments), "--run-id", f"run-{action_id}", "--action-id", action_id))
    row = stack.wait_settled(action_id)
    assert row.outcome == Outcome.completed_verified
    [call] = stack.witness.calls(key=row.idempotency_key)
    assert (call.tool, call.action_id, call.is_error) == ("create_ticket", action_id, False)
    assert stack.effects(row.idempotency_key) == 1
    report = json.loads(ok(cli(stack, "status", action_id, "--json")).stdout)
    assert (report["status"], report["outcome"], report["idempotency_key"]) == (
        row.status.value, row.outcome.value, row.idempotency_key)
    assert [(e["seq"], e["event"]) for e in report["timeline"]] == [
        (e["seq"], e["event"]) for e in stack.timeline(action_id)]
    # forensics numbers its six sections alike for every action: one that needed no recovery says so.
    told = ok(cli(stack, "forensics", action_id)).stdout
    headings = [line.split(".", 1)[0] for line in told.splitlines() if line[:2] in {f"{n}." for n in range(1, 10)}]
    assert headings == ["1", "2", "3", "4", "5", "6"], told
    assert "none: nothing was decided or done after the call" in told


def test_publish_fills_in_the_ids_and_names_who_published(stack: Stack) -> None:
    """Without --action-id and --run-id the CLI makes them as the SDK does, and prints the action
    id; the envelope names the configured requester, else the user and host that published, never
    a placeholder."""
    import getpass
    import socket

    argv = ["--json", "publish", "--action-type", "ticket.create", "--tenant", "acme",
            "--target", json.dumps({"type": "ticket_queue", "id": "acme-ops"}),
            "--args", json.dumps({"tenant": "acme", "title": "no ids given", "owner": "ops"})]
    first = json.loads(ok(cli(stack, *argv)).stdout)
    row = stack.action(first["action_id"])
    assert first["action_id"].startswith("act-") and row.envelope["run_id"] == f"run-{first['action_id']}"
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    assert (row.envelope["requester"], row.envelope["workload_identity"]) == (who, f"proofline-controller:{who}")
    stack.env.update(PROOFLINE_REQUESTER="alice@example.org", PROOFLINE_WORKLOAD_IDENTITY="agent:billing")
    try:
        second = json.loads(ok(cli(stack, *argv)).stdout)
    finally:
        del stack.env["PROOFLINE_REQUESTER"], stack.env["PROOFLINE_WORKLOAD_IDENTITY"]
    envelope = stack.action(second["action_id"]).envelope
    assert second["action_id"] != first["action_id"]
    assert (envelope["requester"], envelope["workload_identity"]) == ("alice@example.org", "agent:billing")
    for action_id in (first["action_id"], second["action_id"]):
        assert stack.wait_settled(action_id).outcome == Outcome.completed_verified


def test_verify_ledger_fails_on_a_tampered_event_and_names_it(stack: Stack) -> None:
    env = ticket_env(stack)
    stack.publish(env)
    stack.wait_settled(env.action_id)
    assert json.loads(ok(cli(stack, "verify-ledger", "--json")).stdout)["ok"] is True
    seq = stack.timeline(env.action_id)[1]["seq"]
    with store.connect(stack.admin_url) as admin:
        original = admin.execute("SELECT evidence FROM ledger_events WHERE action_id = %s AND seq = %s",
                                 (env.action_id, seq)).fetchone()["evidence"]
        rewrite(admin, env.action_id, seq, {"rewritten": True})
        try:
            done = cli(stack, "verify-ledger", "--json")
        finally:
            rewrite(admin, env.action_id, seq, original)
    assert done.returncode == 1, done.stdout + done.stderr
    broken = json.loads(done.stdout)["broken"]
    assert [(b["chain"], b["seq"]) for b in broken] == [(env.action_id, seq)]
    assert json.loads(ok(cli(stack, "verify-ledger", "--json")).stdout)["ok"] is True


def rewrite(admin, action_id: str, seq: int, evidence) -> None:
    """Edit one event as only the table's owner can (the insert-only trigger off for the edit)."""
    with store.transaction(admin) as cur:
        cur.execute("ALTER TABLE ledger_events DISABLE TRIGGER ledger_events_no_update")
        try:
            cur.execute("UPDATE ledger_events SET evidence = %s::jsonb WHERE action_id = %s AND seq = %s",
                        (json.dumps(evidence), action_id, seq))
        finally:
            cur.execute("ALTER TABLE ledger_events ENABLE TRIGGER ledger_events_no_update")


def test_a_kill_switch_set_from_the_command_line_stops_the_next_action_until_cleared(stack: Stack) -> None:
    scope = ("--scope", "tool_tenant", "--value", "create_ticket@acme", "--by", "ops")
    ok(cli(stack, "kill", "set", *scope, "--why", "drill"))
    try:
        blocked = ticket_env(stack)
        stack.publish(blocked)
        row = stack.wait_settled(blocked.action_id)
        assert (row.outcome, row.reason_code) == (Outcome.not_started, "kill_switch_engaged")
        assert stack.witness.count(key=blocked.idempotency_key) == 0 and stack.effects(blocked.idempotency_key) == 0
        # Another tool for the same tenant is outside the switch's scope.
        other = refund_env(stack, new_account(stack))
        stack.publish(other)
        assert stack.wait_settled(other.action_id).outcome == Outcome.completed_verified
    finally:
        ok(cli(stack, "kill", "clear", *scope, "--why", "drill over"))
    allowed = ticket_env(stack)
    stack.publish(allowed)
    assert stack.wait_settled(allowed.action_id).outcome == Outcome.completed_verified
    assert stack.witness.count(key=allowed.idempotency_key) == 1 and stack.effects(allowed.idempotency_key) == 1


def test_reconcile_from_the_command_line_redrives_a_lost_message(stack: Stack) -> None:
    env = ticket_env(stack)
    broker = LosingBroker()
    publish_message(stack.conn, broker, stack.message(env), env, seal_key=stack.seal_key, settings=stack.settings)
    assert len(broker.lost) == 1
    # No beat runs on this stack: until the command runs, nothing re-drives the action.
    def redriven() -> bool:
        if "redriven" not in stack.events(env.action_id):
            assert stack.witness.count(key=env.idempotency_key) == 0
            ok(cli(stack, "reconcile"))  # a no-op until the message is older than the re-drive age
        return "redriven" in stack.events(env.action_id)

    wait_for(redriven, 60, interval=0.5, what="the command line's sweep to re-drive the lost message")
    row = stack.wait_settled(env.action_id)
    assert row.outcome == Outcome.completed_verified
    assert stack.witness.count(key=env.idempotency_key) == 1 and stack.effects(env.idempotency_key) == 1
    [event] = [e for e in stack.timeline(env.action_id) if e["event"] == "redriven"]
    assert (event["actor"], event["evidence"]["reason"]) == ("cli:reconcile", "not_started")
