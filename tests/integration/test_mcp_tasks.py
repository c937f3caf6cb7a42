"""MCP Tasks end to end: real workers, Postgres and the system of record's ``tasks`` variant
(proofline_kit/sor/tasks.py), over stdio and streamable HTTP.

The contract ``ticket.close_task`` closes a ticket through ``close_ticket_task``, a tool that runs
only as a task: the worker creates the task, records its id, polls ``tasks/get`` and reads the
result with ``tasks/result`` (worker/mcp_tasks.py). A cancelled action sends ``tasks/cancel``; a task
that expires first is settled by the verification read; a redelivery after the worker died
mid-task polls the same task and never sends a second ``tools/call``."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ledger.states import ActionStatus, Outcome
from proofline_kit import zygote
from proofline_kit.sor import store as sor
from recovery.cancel import cancel
from tests.conftest import ROOT, Stack, build_stack, start_workers, teardown_stack, wait_for
from worker.dispatch import CeleryDispatch
from worker.faultpoints import arm, fired

TASK_CONTRACT = {
    "action_type": "ticket.close_task", "version": 1, "server": "sor", "tool": "close_ticket_task",
    "operation": "close", "target_type": "ticket", "result": {"mode": "structured"}, "timeout_seconds": 5,
    "mcp_task": {"ttl_seconds": 30},
    "precondition_read": {"tool": "get_ticket", "arguments": {"ticket_id": "target.id"}},
    "preconditions": [
        {"name": "target_exists", "expr": "before.found", "reason": "target_missing"},
        {"name": "reviewed_version", "expr": "before.ticket.version == target.expected_version",
         "reason": "stale_version"},
        {"name": "state_allows_close", "expr": "before.ticket.status == 'open'", "reason": "state_forbids"}],
    "verification": {
        "max_duration_seconds": 10, "poll_interval_seconds": 0.2,
        # The task's job may still be running when its record is gone: an untouched ticket read
        # before then is not evidence that it never ran.
        "consistency_delay_seconds": 3,
        "expected": ["after.found && after.ticket.status == 'closed'",
                     "after.ticket.version == target.expected_version + 1"],
        "prohibited": ["after.found && after.ticket.version > target.expected_version + 1"],
        "absent": "after.found && after.ticket.status == 'open' && after.ticket.version == target.expected_version"},
}


def task_stack(transport: str, tmp: Path) -> Stack:
    contracts = tmp / "contracts"
    shutil.copytree(ROOT / "contracts", contracts)
    (contracts / "ticket.close_task.yaml").write_text(yaml.safe_dump(TASK_CONTRACT, sort_keys=False))
    pins = tmp / "pins.json"
    s = build_stack(transport, tmp / "stack", extra_env={
        "PROOFLINE_CONTRACTS_DIR": str(contracts), "PROOFLINE_PINS_FILE": str(pins),
        "SOR_CONTRACT_VARIANT": "tasks"})
    try:
        if transport == "http":  # the HTTP servers start before extra_env applies: the writer again, with it
            s.restart_writer(SOR_CONTRACT_VARIANT="tasks")
        done = zygote.run([sys.executable, "-m", "proofline", "contracts", "pin", "--by", "test"], env=s.env,
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        start_workers(s)
    except BaseException:
        teardown_stack(s)
        raise
    return s


@pytest.fixture(scope="module", params=["stdio", "http"])
def tstack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # The controller's own look at the server (from this process) must see the variant the workers see.
    previous = os.environ.get("SOR_CONTRACT_VARIANT")
    os.environ["SOR_CONTRACT_VARIANT"] = "tasks"
    try:
        s = task_stack(request.param, tmp_path_factory.mktemp(f"tasks-{request.param}"))
        try:
            yield s
        finally:
            teardown_stack(s)
    finally:
        if previous is None:
            os.environ.pop("SOR_CONTRACT_VARIANT", None)
        else:
            os.environ["SOR_CONTRACT_VARIANT"] = previous


@pytest.fixture(autouse=True)
def _clear(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "tstack" in request.fixturenames:
        request.getfixturevalue("tstack").disarm()


def close_env(s: Stack) -> Any:
    ticket = sor.put_ticket(s.sor_db, "acme", "close as a task", "ops")
    return s.envelope("ticket.close_task", arguments={"ticket_id": ticket, "expected_version": 1},
                      target={"type": "ticket", "id": ticket, "expected_version": 1})


def evidence(s: Stack, action_id: str, event: str) -> list[dict[str, Any]]:
    return [e["evidence"] for e in s.timeline(action_id) if e["event"] == event]


def test_a_task_tool_is_created_polled_retrieved_and_verified(tstack: Stack) -> None:
    env = close_env(tstack)
    tstack.publish(env)
    row = tstack.wait_settled(env.action_id, timeout=90)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    created = evidence(tstack, env.action_id, "mcp_task_created")
    assert len(created) == 1 and created[0]["task_id"].startswith("task-")
    assert isinstance(created[0]["mcp_request_id"], int) and created[0]["mcp_connection"]
    [called] = evidence(tstack, env.action_id, "tool_called")
    task = called["mcp_task"]
    assert task["task_id"] == created[0]["task_id"] and task["final_status"] == "completed"
    assert task["status_total"] >= 2 and task["statuses"][0]["status"] == "working"
    assert called["mcp_request_id"] == created[0]["mcp_request_id"]  # the tools/call's id
    assert task["polls"]["mcp_request_id"] and task["result_request"]["mcp_request_id"]
    assert called["outcome"] == Outcome.completed_unverified.value
    assert tstack.witness.count(key=env.idempotency_key) == 1
    assert tstack.effects(env.idempotency_key) == 1


def test_a_cancelled_action_cancels_its_task(tstack: Stack) -> None:
    env = close_env(tstack)
    sor.set_fault(tstack.sor_db, "close_ticket_task", "delay", delay_seconds=20)
    tstack.publish(env)
    tstack.wait_event(env.action_id, "mcp_task_created")
    cancel(tstack.operator, CeleryDispatch(tstack.app), env.action_id, "test-operator", "stop the task")
    row = tstack.wait_settled(env.action_id, timeout=90)
    [sent] = evidence(tstack, env.action_id, "mcp_task_cancel_sent")
    assert sent["status"] == "cancelled" and isinstance(sent["mcp_request_id"], int)
    [called] = evidence(tstack, env.action_id, "tool_called")
    assert called["reason_code"] == "cancelled_in_flight" and called["mcp_task"]["cancel"]["status"] == "cancelled"
    assert (row.status, row.outcome) == (ActionStatus.cancelled, Outcome.failed_before_side_effect)
    assert tstack.effects(env.idempotency_key) == 0


def test_an_expired_task_is_settled_by_the_authoritative_read(tstack: Stack) -> None:
    env = close_env(tstack)
    # The server grants 0.4 s of time to live for a job that takes 1.5 s: the record is gone first.
    sor.set_fault(tstack.sor_db, "close_ticket_task:ttl", "delay", delay_seconds=0.4)
    sor.set_fault(tstack.sor_db, "close_ticket_task", "delay", delay_seconds=1.5)
    tstack.publish(env)
    row = tstack.wait_settled(env.action_id, timeout=90)
    [called] = evidence(tstack, env.action_id, "tool_called")
    assert (called["outcome"], called["reason_code"]) == (Outcome.unknown_outcome.value, "mcp_task_expired")
    assert called["error"]["type"] == "McpTaskExpired" and called["mcp_task"]["task_id"]
    [expired] = evidence(tstack, env.action_id, "mcp_task_expired")
    assert expired["reason_code"] == "mcp_task_expired" and expired["task_id"] == called["mcp_task"]["task_id"]
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert tstack.effects(env.idempotency_key) == 1


def test_a_redelivery_mid_task_resumes_the_same_task(tstack: Stack) -> None:
    env = close_env(tstack)
    before = fired(tstack.faultpoints, "after_task_created")
    arm(tstack.faultpoints, "after_task_created", remaining=1, action_id=env.action_id)
    tstack.publish(env)
    row = tstack.wait_settled(env.action_id, timeout=120)
    assert fired(tstack.faultpoints, "after_task_created") == before + 1, "the worker must really have died"
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    [created] = evidence(tstack, env.action_id, "mcp_task_created")
    resumed = evidence(tstack, env.action_id, "mcp_task_resumed")
    assert [r["task_id"] for r in resumed] == [created["task_id"]]
    [called] = evidence(tstack, env.action_id, "tool_called")
    assert called["mcp_task"]["resumed"] and "mcp_request_id" not in called
    assert "reconcile_required" not in tstack.events(env.action_id)  # polled again, not reconciled
    # The redelivery's read may already show the task's own close (the HTTP writer lived on and
    # finished the job): recorded as such, and the task is still polled rather than called again.
    failed = evidence(tstack, env.action_id, "preconditions_failed")
    assert all(f["on"] == "task_resume" for f in failed)
    assert tstack.witness.count(key=env.idempotency_key) == 1  # one tools/call, one task
    assert tstack.effects(env.idempotency_key) == 1
    wait_for(tstack.workers_alive, 10, what="Celery to replace the killed pool process")
