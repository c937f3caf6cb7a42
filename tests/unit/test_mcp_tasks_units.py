"""MCP Tasks without services: discovery from negotiated capabilities, the bounded status log, the
classification of an expired task and the contract's ``mcp_task`` bounds (worker/mcp_tasks.py)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from ledger.states import Outcome
from proofline.contracts import McpTask, contract_for
from proofline.errors import McpTaskExpired
from proofline.settings import ROOT
from worker.classify import CallReport, classify
from worker.mcp_tasks import EXTENSION, TaskLog, advertised

contract = partial(contract_for, ROOT / "contracts")


@pytest.mark.parametrize(("capabilities", "expected"), [
    ({"tasks": {"requests": {"tools": {"call": {}}}}}, True),  # 2025-11-25
    ({"extensions": {EXTENSION: {}}}, True),  # 2026-07-28
    ({"tasks": {"requests": {"tools": {}}}, "extensions": {"io.example/other": {}}}, False),
    ({"tasks": {"cancel": {}}}, False),  # tasks, but not for tools/call
    ({}, False),
])
def test_tasks_are_used_only_where_the_server_advertises_them(capabilities, expected):
    assert advertised(capabilities) is expected


def status(value: str, message: str = "") -> SimpleNamespace:
    return SimpleNamespace(status=value, status_message=message)


def test_the_status_log_counts_every_status_and_keeps_a_bounded_run_of_changes():
    log = TaskLog(limit=3)
    for i in range(50):
        log.saw(status("working", f"step {i // 10}"))
    log.saw(status("completed"))
    evidence = log.evidence()
    assert evidence["status_total"] == 51
    # Repeats of one status are kept once; past the bound nothing more is kept, all is counted.
    assert evidence["statuses"] == [{"status": "working", "message": "step 0"},
                                    {"status": "working", "message": "step 1"},
                                    {"status": "working", "message": "step 2"}]
    assert evidence["final_status"] == "completed"


def test_an_expired_task_is_an_unknown_outcome_left_to_verification():
    exc = McpTaskExpired("the server no longer knows task task-1", task_id="task-1")
    verdict = classify(CallReport(sent=True, error=exc, task={"task_id": "task-1"}), contract("ticket.close"))
    assert verdict.outcome is Outcome.unknown_outcome
    assert verdict.reason_code == "mcp_task_expired"
    assert verdict.evidence["task_id"] == "task-1"


def test_a_task_policy_has_a_positive_bounded_time_to_live():
    assert McpTask().ttl_seconds == 60
    with pytest.raises(ValidationError):
        McpTask(ttl_seconds=0)
    with pytest.raises(ValidationError):
        McpTask(ttl_seconds=10**6)
