"""The operator's commands against a running stack: listing and following actions, runs, kill
switch validation, revocations, and retrying an escalated action whose effect is proven absent."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.settings import ROOT
from proofline_kit import zygote
from proofline_kit.sor import store as sor
from proofline_kit.stack import disarm_fault_points
from tests.conftest import Stack, wait_for
from tests.integration.cli_run import as_json, assert_error, environment, proofline, text
from worker import faultpoints

STAMP = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3} UTC")


def _tenant() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def _publish(stack: Stack, tenant: str, **kw: Any) -> str:
    envelope = stack.envelope("ticket.create", tenant=tenant, target={"type": "ticket_queue", "id": f"{tenant}-ops"},
                              arguments={"tenant": tenant, "title": f"cli {uuid.uuid4().hex[:6]}", "owner": "ops"}, **kw)
    stack.publish(envelope)
    return envelope.action_id


def test_actions_list_follow_prints_each_new_action_and_each_move(stack: Stack) -> None:
    """``actions list --follow``: the page first (here: nothing yet), then one line each time an
    action of the filter appears or its status moves, until --stop-after."""
    tenant = _tenant()
    watcher = zygote.spawn([sys.executable, "-m", "proofline", "actions", "list", "--tenant", tenant, "--follow",
                                "--interval", "0.2", "--stop-after", "90"], env=environment(stack), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout is not None
        assert watcher.stdout.readline().strip() == "no actions match these filters"
        action_id = _publish(stack, tenant)
        statuses = []
        while "closed" not in statuses:
            line = watcher.stdout.readline()
            assert line, watcher.stderr.read() if watcher.stderr else "the watcher ended"
            fields = line.split()
            assert fields[3] == action_id, line  # published (three fields), then the action
            statuses.append(fields[6])
        assert statuses[-1] == "closed" and len(statuses) == len(set(statuses)), statuses  # each move once
        assert "completed_verified" in line
    finally:
        watcher.terminate()
        watcher.wait(30)
    assert_error(proofline(stack, "actions", "list", "--follow", "--before", f"{datetime.now(UTC).isoformat()}|x"), 2,
                 "usage", "not with --json or --before")


def test_actions_list_filters_pages_and_says_when_nothing_matches(stack: Stack) -> None:
    tenant = _tenant()
    verified = _publish(stack, tenant)
    expired = _publish(stack, tenant, approval_ttl=timedelta(seconds=-1))
    assert stack.wait_settled(verified).outcome == Outcome.completed_verified
    assert stack.wait_settled(expired).outcome == Outcome.not_started

    def ids(*args: str) -> list[str]:
        return [a["action_id"] for a in as_json(proofline(stack, "--json", "actions", "list", *args))["actions"]]

    assert ids("--tenant", tenant) == [expired, verified]  # newest first
    assert ids("--tenant", tenant, "--outcome", "completed_verified") == [verified]
    assert ids("--tenant", tenant, "--outcome", "not_started", "--status", "closed") == [expired]
    assert ids("--tenant", tenant, "--action-type", "ticket.close") == []
    assert ids("--tenant", tenant, "--since", "1h") == [expired, verified]
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert ids("--tenant", tenant, "--since", future) == []
    first = as_json(proofline(stack, "--json", "actions", "list", "--tenant", tenant, "--limit", "1"))
    assert [a["action_id"] for a in first["actions"]] == [expired] and first["next"]
    assert ids("--tenant", tenant, "--limit", "1", "--before", first["next"]) == [verified]
    # Text: a table with dated, zoned timestamps, no JSON, and a sentence for an empty result.
    table = text(proofline(stack, "actions", "list", "--tenant", tenant))
    assert verified in table and expired in table and "approval_expired" in table and STAMP.search(table)
    assert "None" not in table
    empty = text(proofline(stack, "actions", "list", "--tenant", tenant, "--since", future))
    assert empty.strip() == "no actions match these filters"
    assert_error(proofline(stack, "actions", "list", "--since", "yesterday"), 2, "usage", "--since")
    assert_error(proofline(stack, "actions", "list", "--status", "done"), 2, "usage", "--status")
    # Runs: listed with the outcome derived from their steps.
    runs = as_json(proofline(stack, "--json", "runs", "list", "--tenant", tenant))["runs"]
    assert {r["run_id"]: r["outcome"] for r in runs} == {stack.action(verified).run_id: "completed",
                                                         stack.action(expired).run_id: "failed"}
    assert text(proofline(stack, "runs", "list", "--tenant", _tenant())).strip() == "no runs match these filters"


def test_status_never_prints_none_and_follow_streams_until_the_action_settles(stack: Stack) -> None:
    tenant = _tenant()
    sor.set_fault(stack.sor_db, "create_ticket", "delay", remaining=1, delay_seconds=1.5)
    action_id = _publish(stack, tenant)
    follow = zygote.spawn([sys.executable, "-m", "proofline", "status", action_id, "--follow", "--timeout", "60",
                               "--interval", "0.1"], env=environment(stack), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        out, err = follow.communicate(timeout=90)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 0, err
    lines = out.splitlines()
    events = [line.split()[4] for line in lines if STAMP.search(line) and line.startswith("  ")]
    assert events[0] == "published" and "tool_called" in events and events[-1] == "final_state", out
    assert events == stack.events(action_id)[:len(events)], (events, stack.events(action_id))
    assert re.search(r"^status\s+closed\s+outcome completed_verified", out, re.M), out
    report = text(proofline(stack, "status", action_id))
    assert "None" not in report and "finding expected" in report and STAMP.search(report)
    done = as_json(proofline(stack, "--json", "status", action_id, "--follow"))
    assert done["status"] == "closed" and done["timeline"][-1]["event"] == "final_state"
    # Following one that does not settle in time ends with its own exit code. Its worker is held
    # before the call until the command has given up, however long the command takes to start.
    held = faultpoints.fired(stack.faultpoints, "before_send")
    faultpoints.arm(stack.faultpoints, "before_send", remaining=1, action="hold", seconds=120)
    slow = _publish(stack, tenant)
    try:
        wait_for(lambda: faultpoints.fired(stack.faultpoints, "before_send") > held, 120,
                 what="the worker to be held before its call")
        late = proofline(stack, "--json", "status", slow, "--follow", "--timeout", "0.5")
    finally:
        disarm_fault_points(stack.faultpoints)
    assert late.returncode == 15 and late.stdout == ""
    assert json.loads(late.stderr)["error"] == "follow_timed_out"
    assert stack.wait_settled(slow).outcome == Outcome.completed_verified


@pytest.mark.timeout(600)  # a dozen commands, each an interpreter's start: minutes on a loaded host
def test_kill_switch_values_are_validated_and_a_valid_one_blocks(stack: Stack) -> None:
    tenant = _tenant()
    first = _publish(stack, tenant)
    stack.wait_settled(first)
    who = ["--by", "ops@example.com", "--why", "drill"]
    assert_error(proofline(stack, "kill", "set", "--scope", "tool", *who), 12, "kill_switch_invalid", "needs a value")
    assert_error(proofline(stack, "kill", "set", "--scope", "tool_tenant", "--value", "create_ticket", *who), 12,
                 "kill_switch_invalid", "TOOL@TENANT")
    assert_error(proofline(stack, "kill", "set", "--scope", "tool", "--value", "crate_ticket", *who), 12,
                 "kill_switch_invalid", "no tool 'crate_ticket'", "create_ticket")
    assert_error(proofline(stack, "kill", "set", "--scope", "action_type", "--value", "ticket.crate", *who), 12,
                 "kill_switch_invalid", "no action type")
    assert_error(proofline(stack, "kill", "set", "--scope", "global", "--value", "x", *who), 12,
                 "kill_switch_invalid", "no value")
    newcomer = _tenant()
    assert_error(proofline(stack, "kill", "set", "--scope", "tenant", "--value", newcomer, *who), 12,
                 "kill_switch_invalid", f"no tenant '{newcomer}'", "--any-tenant")
    assert newcomer not in text(proofline(stack, "kill", "list"))
    value = f"create_ticket@{tenant}"
    try:
        assert "set" in text(proofline(stack, "kill", "set", "--scope", "tool_tenant", "--value", value, *who))
        assert "set" in text(proofline(stack, "kill", "set", "--scope", "tenant", "--value", newcomer,
                                       "--any-tenant", *who))
        engaged = as_json(proofline(stack, "--json", "kill", "list"))["kill_switches"]
        assert {(r["scope"], r["value"]) for r in engaged} >= {("tool_tenant", "*:" + value), ("tenant", newcomer)}
        blocked = _publish(stack, tenant)
        row = stack.wait_settled(blocked)
        assert (row.outcome, row.reason_code) == (Outcome.not_started, "kill_switch_engaged")
        assert stack.effects(row.idempotency_key) == 0
    finally:
        proofline(stack, "kill", "clear", "--scope", "tool_tenant", "--value", value, *who)
        proofline(stack, "kill", "clear", "--scope", "tenant", "--value", newcomer, *who)
    assert value not in text(proofline(stack, "kill", "list"))


def test_revocations_are_listed_and_lifted(stack: Stack) -> None:
    identity = f"agent:cli-{uuid.uuid4().hex[:6]}"
    who = ["--by", "ops@example.com"]
    try:
        assert text(proofline(stack, "revoke", identity, *who, "--reason", "leaked token")).strip() == f"revoked {identity}"
        listed = as_json(proofline(stack, "--json", "revocations", "list"))["revocations"]
        assert [r["reason"] for r in listed if r["identity"] == identity] == ["leaked token"]
        blocked = _publish(stack, _tenant(), workload_identity=identity)
        assert stack.wait_settled(blocked).reason_code == "identity_revoked"
    finally:
        lifted = proofline(stack, "revocations", "lift", identity, *who, "--why", "token rotated")
    assert lifted.returncode == 0, lifted.stderr
    assert identity not in text(proofline(stack, "revocations", "list"))
    assert stack.events(f"revocation:{identity}") == ["identity_revoked", "revocation_lifted"]
    assert_error(proofline(stack, "revocations", "lift", identity, *who, "--why", "again"), 6, "not_found")
    again = _publish(stack, _tenant(), workload_identity=identity)
    assert stack.wait_settled(again).outcome == Outcome.completed_verified


def test_retry_sends_an_escalated_action_whose_effect_is_proven_absent(stack: Stack) -> None:
    # The server says it created the ticket but did not: verification finds nothing, and with one
    # attempt allowed, recovery escalates instead of retrying.
    sor.set_fault(stack.sor_db, "create_ticket", "lie", remaining=1)
    action_id = _publish(stack, _tenant(), retry_policy={"max_attempts": 1, "backoff_seconds": 0.1})
    row = stack.wait_settled(action_id)
    assert (row.status, row.outcome, row.finding, row.reason_code) == (
        ActionStatus.escalated, Outcome.failed_before_side_effect, "absent", "retries_exhausted")
    assert stack.effects(row.idempotency_key) == 0
    retry = ["retry", action_id, "--by", "ops@example.com", "--why", "the server is fixed"]
    sent = as_json(proofline(stack, "--json", *retry))
    assert sent["retried"] is True and sent["proof"] == {"outcome": "failed_before_side_effect", "finding": "absent",
                                                         "idempotency_record": "failed"}

    def verified():
        now = stack.action(action_id)
        return now if now.status == ActionStatus.closed else None

    final = wait_for(verified, 40, what=f"{action_id} to be verified after the retry")
    assert final.outcome == Outcome.completed_verified
    assert stack.effects(row.idempotency_key) == 1
    manual = next(e for e in stack.timeline(action_id) if e["event"] == "manual_retry")
    assert manual["actor"] == "ops@example.com" and manual["evidence"]["reason"] == "the server is fixed"
    events = stack.events(action_id)
    assert events.index("manual_retry") < events.index("idempotency_reclaimed") < events.index("final_state")
    # Retrying it again is refused: it is no longer escalated.
    assert_error(proofline(stack, *retry), 11, "retry_not_escalated", "closed")
    assert_error(proofline(stack, "retry", f"{action_id}-nope", *retry[2:]), 6, "not_found")


def test_retry_is_refused_when_the_effect_is_not_proven_absent(stack: Stack) -> None:
    # The verification read path is down: the call's effect is unverified, so it is escalated
    # as completed_unverified, and nothing proves a second call safe.
    sor.set_read_outage(stack.sor_db, True, role="reader")
    try:
        action_id = _publish(stack, _tenant())
        row = stack.wait_settled(action_id, timeout=60)
    finally:
        sor.set_read_outage(stack.sor_db, False, role="reader")
    assert (row.status, row.outcome) == (ActionStatus.escalated, Outcome.completed_unverified)
    out = proofline(stack, "retry", action_id, "--by", "ops@example.com", "--why", "try again")
    assert_error(out, 11, "effect_not_proven_absent", "completed_unverified")
    assert stack.action(action_id).status == ActionStatus.escalated
    assert "manual_retry" not in stack.events(action_id)
    assert stack.effects(row.idempotency_key) == 1
    queue = as_json(proofline(stack, "--json", "manual", "list"))["actions"]
    assert action_id in [a["action_id"] for a in queue]
    assert json.dumps(queue)  # one JSON document, every value serialisable
    text = proofline(stack, "manual", "list").stdout.splitlines()
    assert text[0].split() == ["escalated", "action", "type", "tenant", "outcome", "reason", "recovery"], text[0]
    assert any(line.split()[3] == action_id for line in text[1:]), text  # the time takes three fields


def test_retry_is_refused_past_the_call_budget_or_the_approval(stack: Stack) -> None:
    """Both effects are proven absent, but one approval allowed a single call, and the other has
    expired since: neither is sent again."""
    sor.set_fault(stack.sor_db, "create_ticket", "lie", remaining=2)
    once = {"max_attempts": 1, "backoff_seconds": 0.1}
    spent = _publish(stack, _tenant(), retry_policy=once, authority_budget={"max_calls": 1})
    expiring = _publish(stack, _tenant(), retry_policy=once, approval_ttl=timedelta(seconds=8))
    for action_id in (spent, expiring):
        row = stack.wait_settled(action_id)
        assert (row.status, row.finding) == (ActionStatus.escalated, "absent"), row
    who = ["--by", "ops@example.com", "--why", "try again"]
    assert_error(proofline(stack, "retry", spent, *who), 11, "retry_budget_exhausted", "(1 of 1)")
    approval = stack.action(expiring).envelope["approval"]["expires_at"]
    wait_for(lambda: datetime.now(UTC) > datetime.fromisoformat(approval), 15, what="the approval to expire")
    assert_error(proofline(stack, "retry", expiring, *who), 11, "retry_expired", "approval expired")
    for action_id in (spent, expiring):
        assert stack.action(action_id).status == ActionStatus.escalated
        assert "manual_retry" not in stack.events(action_id)
