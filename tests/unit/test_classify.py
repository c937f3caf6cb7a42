"""Classification of one tool call from trusted facts, with real MCP result objects and real
exception types, plus the executor's "was the request sent?" test."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpcore2
import httpx2
import pytest
from mcp import MCPError
from mcp.types import CallToolResult, TextContent

from ledger.states import Outcome
from proofline.contracts import ToolErrors, contract_for
from proofline.errors import McpUnavailable, SandboxAuditOverflow
from proofline.settings import ROOT
from worker.classify import REFUSED_BEFORE_RUNNING, CallReport, classify
from worker.tool_call import _sent

contract = partial(contract_for, ROOT / "contracts")


def result(*texts: str, structured: dict[str, Any] | None = None, is_error: bool = False) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=t) for t in texts],
                          structured_content=structured, is_error=is_error)


def raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    """The exception as the executor sees it: actually raised, with its chain set by Python."""
    try:
        if cause is None:
            raise exc
        try:
            raise cause
        except BaseException as inner:
            raise exc from inner
    except BaseException as caught:  # noqa: BLE001
        return caught


# --- transport and protocol failures --------------------------------------------------------------


def test_not_sent_is_failed_before_side_effect():
    verdict = classify(CallReport(sent=False, error=ConnectionRefusedError(111, "Connection refused")),
                       contract("ticket.create"))
    assert verdict.outcome is Outcome.failed_before_side_effect
    assert verdict.reason_code == "not_sent"
    assert verdict.evidence["error"]["type"] == "ConnectionRefusedError"


def test_timeout_after_send_is_unknown_outcome():
    verdict = classify(CallReport(sent=True, error=TimeoutError("read timed out")), contract("ticket.create"))
    assert verdict.outcome is Outcome.unknown_outcome
    assert verdict.reason_code == "response_lost"


@pytest.mark.parametrize("code", sorted(REFUSED_BEFORE_RUNNING))
def test_protocol_refusal_is_failed_before_side_effect(code):
    verdict = classify(CallReport(sent=True, error=MCPError(code, "refused")), contract("ticket.create"))
    assert verdict.outcome is Outcome.failed_before_side_effect
    assert verdict.reason_code == "protocol_refused"
    assert verdict.evidence["error"]["code"] == code


def test_invalid_params_is_failed_before_side_effect():
    verdict = classify(CallReport(sent=True, error=MCPError(-32602, "Invalid params: amount_cents")),
                       contract("refund.issue"))
    assert verdict.outcome is Outcome.failed_before_side_effect
    assert verdict.evidence["error"]["message"] == "Invalid params: amount_cents"


@pytest.mark.parametrize("code", [-32603, -32000, -32001])
def test_other_protocol_errors_after_send_are_unknown(code):
    """Internal / server errors may come after the tool already ran."""
    verdict = classify(CallReport(sent=True, error=MCPError(code, "internal")), contract("ticket.create"))
    assert verdict.outcome is Outcome.unknown_outcome
    assert verdict.evidence["error"]["code"] == code


def test_exception_group_after_send_is_unknown_with_inner_errors():
    group = BaseExceptionGroup("task group failed", [ConnectionResetError("reset"), TimeoutError("late")])
    verdict = classify(CallReport(sent=True, error=group), contract("ticket.create"))
    assert verdict.outcome is Outcome.unknown_outcome
    assert [e["type"] for e in verdict.evidence["error"]["inner"]] == ["ConnectionResetError", "TimeoutError"]


def test_exception_group_not_sent_is_failed_before_side_effect():
    group = BaseExceptionGroup("connect failed", [ConnectionRefusedError("refused")])
    verdict = classify(CallReport(sent=False, error=group), contract("ticket.create"))
    assert verdict.outcome is Outcome.failed_before_side_effect


# --- tool errors ---------------------------------------------------------------------------------


def test_structured_error_class_after_side_effect():
    res = result("ticket written, notification failed", structured={"error_class": "failed_after_side_effect"},
                 is_error=True)
    verdict = classify(CallReport(sent=True, result=res), contract("ticket.create"))
    assert verdict.outcome is Outcome.failed_after_side_effect
    assert verdict.reason_code == "tool_error:failed_after_side_effect"
    assert verdict.evidence["error_class"] == "failed_after_side_effect"


def test_error_class_in_json_text_only_is_mapped():
    text = json.dumps({"error_class": "failed_before_side_effect", "detail": "queue is read-only"})
    verdict = classify(CallReport(sent=True, result=result(text, is_error=True)), contract("ticket.create"))
    assert verdict.outcome is Outcome.failed_before_side_effect
    assert verdict.reason_code == "tool_error:failed_before_side_effect"
    assert verdict.evidence["text"] == text


def test_structured_class_wins_over_text():
    res = result(json.dumps({"error_class": "failed_before_side_effect"}),
                 structured={"error_class": "failed_after_side_effect"}, is_error=True)
    verdict = classify(CallReport(sent=True, result=res), contract("ticket.create"))
    assert verdict.outcome is Outcome.failed_after_side_effect


@pytest.mark.parametrize(
    "res",
    [
        result("something went wrong", is_error=True),
        result(json.dumps({"error_class": "cosmic_rays"}), is_error=True),
        result(json.dumps({"error_class": 7}), is_error=True),
        result(json.dumps(["failed_before_side_effect"]), is_error=True),
        result(is_error=True),
    ],
    ids=["plain-text", "unknown-class", "non-string-class", "json-list", "empty"],
)
def test_unclassified_tool_error_takes_the_contract_default(res):
    c = contract("ticket.create")
    verdict = classify(CallReport(sent=True, result=res), c)
    assert verdict.outcome is Outcome(c.tool_errors.default)
    assert verdict.outcome is Outcome.unknown_outcome


def test_contract_default_is_what_decides():
    c = contract("ticket.create")
    lenient = c.model_copy(update={"tool_errors": ToolErrors(default="failed_before_side_effect")})
    res = result("validation failed: title too long", is_error=True)
    assert classify(CallReport(sent=True, result=res), c).outcome is Outcome.unknown_outcome
    verdict = classify(CallReport(sent=True, result=res), lenient)
    assert verdict.outcome is Outcome.failed_before_side_effect
    assert verdict.reason_code == "tool_error:unclassified"


def test_contract_specific_class_names_map():
    c = contract("ticket.create").model_copy(update={"tool_errors": ToolErrors(
        class_field="kind", classes={"conflict": "failed_before_side_effect"})})
    res = result(structured={"kind": "conflict", "error_class": "failed_after_side_effect"}, is_error=True)
    assert classify(CallReport(sent=True, result=res), c).outcome is Outcome.failed_before_side_effect


# --- successes ------------------------------------------------------------------------------------


def test_async_success_is_accepted_with_operation_id():
    res = result("restart started", structured={"operation_id": "op-42", "service": "api", "state": "restarting"})
    verdict = classify(CallReport(sent=True, result=res), contract("service.restart"))
    assert verdict.outcome is Outcome.accepted
    assert verdict.operation_id == "op-42"
    assert verdict.values == res.structured_content


def test_async_success_without_operation_id_is_unknown():
    res = result(structured={"service": "api", "state": "restarting"})
    verdict = classify(CallReport(sent=True, result=res), contract("service.restart"))
    assert verdict.outcome is Outcome.unknown_outcome
    assert verdict.reason_code == "operation_id_missing"


def test_plain_success_is_completed_unverified():
    ticket = {"ticket": {"id": "T-9", "title": "Disk full", "tenant": "acme", "version": 1}}
    verdict = classify(CallReport(sent=True, result=result(json.dumps(ticket), structured=ticket)),
                       contract("ticket.create"))
    assert verdict.outcome is Outcome.completed_unverified
    assert verdict.reason_code == "tool_reported_success"
    assert verdict.values == ticket
    assert verdict.operation_id is None


def test_pattern_success_reads_the_refund_text():
    res = result("refund R-3 issued for 1500 cents on acct-1")
    verdict = classify(CallReport(sent=True, result=res), contract("refund.issue"))
    assert verdict.outcome is Outcome.completed_unverified
    assert verdict.values == {"refund_id": "R-3", "amount_cents": 1500, "account": "acct-1"}


@pytest.mark.parametrize(
    ("action_type", "res"),
    [
        ("refund.issue", result("refund queued, id to follow")),
        ("ticket.create", result("ticket created")),
        ("ticket.create", result(json.dumps([1, 2]))),
        ("service.restart", result()),
    ],
    ids=["pattern-miss", "text-not-json", "json-not-object", "empty"],
)
def test_unreadable_success_is_unknown_outcome(action_type, res):
    verdict = classify(CallReport(sent=True, result=res), contract(action_type))
    assert verdict.outcome is Outcome.unknown_outcome
    assert verdict.reason_code == "extraction_failed"
    assert verdict.values is None


# --- was the request sent? --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError(111, "Connection refused"),
        McpUnavailable("no session"),
        httpx2.ConnectError("All connection attempts failed"),
        httpcore2.ConnectError("connect failed"),
        raised(RuntimeError("session failed"), cause=httpx2.ConnectError("All connection attempts failed")),
        raised(McpUnavailable("cannot open a session"), cause=httpcore2.ConnectError("refused")),
        raised(RuntimeError("outer"), cause=raised(ValueError("middle"), cause=ConnectionRefusedError("refused"))),
        BaseExceptionGroup("connect", [ConnectionRefusedError("refused")]),
    ],
    ids=["refused", "mcp-unavailable", "httpx-connect", "httpcore-connect", "chained-connect",
         "unavailable-from-connect", "deep-chain", "group-of-refused"],
)
def test_connect_failures_were_not_sent(exc):
    assert _sent(exc) is False


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("boom"),
        TimeoutError("read timed out"),
        ConnectionResetError("reset by peer"),
        httpx2.ReadTimeout("read timeout"),
        MCPError(-32603, "internal error"),
        raised(RuntimeError("outer"), cause=TimeoutError("inner")),
        BaseExceptionGroup("mixed", [TimeoutError("late"), ConnectionRefusedError("refused")]),
    ],
    ids=["generic", "timeout", "reset", "read-timeout", "mcp-error", "chained-timeout", "group-mixed"],
)
def test_other_failures_count_as_sent(exc):
    assert _sent(exc) is True


def test_a_fail_closed_audit_overflow_says_whether_the_call_was_sent():
    """A call refused on an incomplete sandbox audit (worker/sandbox_reader.py) after it was sent is
    an unknown outcome under its own code; refused before sending, nothing happened."""
    after = SandboxAuditOverflow("lost lines during the call", sent=True, server="s", role="write")
    before = SandboxAuditOverflow("lost lines before the call", sent=False, server="s", role="write")
    assert _sent(after) is True and _sent(before) is False
    assert _sent(raised(RuntimeError("outer"), cause=before)) is False
    verdict = classify(CallReport(sent=_sent(after), error=after), contract("ticket.create"))
    assert verdict.outcome == Outcome.unknown_outcome and verdict.reason_code == "sandbox_audit_overflow"
    assert verdict.evidence["server"] == "s"
    unsent = classify(CallReport(sent=_sent(before), error=before), contract("ticket.create"))
    assert unsent.outcome == Outcome.failed_before_side_effect
    # It pickles with its context (Celery moves exceptions between processes).
    import pickle

    assert pickle.loads(pickle.dumps(before)).sent is False
