"""Classify what one tool call did, from trusted facts only (never from a model's reading).

The rules, in order:
- nothing was sent (no session, refused connection) → failed before side effect;
- the request was sent and then the response path failed (timeout, reset, lost connection,
  output-schema error, cancellation) → unknown outcome: never retried blindly; cut at the absolute
  deadline (however much progress arrived) → unknown outcome, ``absolute_deadline_reached``;
- a tool error with a machine-readable class → the class the contract maps it to; without one
  → the contract's default (unknown outcome unless the contract knows better);
- a result larger than the limit for its server and contract, or a message the transport stopped
  reading (``worker/bounded_stdio.py``) → unknown outcome (it was sent and the tool may have acted;
  nothing of it is parsed, verification settles it);
- a success from an asynchronous tool → accepted, with its downstream operation id;
- any other success → completed but unverified, until verification says otherwise.
MCP protocol errors and tool errors are different channels and are kept apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ledger.states import Outcome
from proofline.conditions import evaluate
from proofline.contracts import Contract, extract
from proofline.errors import (
    AbsoluteDeadlineReached,
    ConditionError,
    ExtractionFailed,
    McpTaskExpired,
    ResultTooLarge,
    SandboxAuditOverflow,
    ServerAuthFailed,
    TokenExchangeRefused,
)
from worker.results import measure
from worker.server_requests import refused_by_runtime
from worker.stdio_lines import MESSAGE_TOO_LARGE

# JSON-RPC errors the server sends *before* running the tool: the request was refused outright.
REFUSED_BEFORE_RUNNING = {-32700, -32600, -32601, -32602}


@dataclass(frozen=True)
class CallReport:
    """What the executor observed for one call."""

    sent: bool
    result: Any = None
    error: BaseException | None = None
    elapsed_seconds: float = 0.0
    progress: tuple[dict[str, Any], ...] = ()
    progress_total: int = 0
    #: The sandboxed server was killed by a limit while this call was in flight (worker/sandbox.py).
    sandbox_violation: dict[str, Any] | None = None
    #: Why the server runs unsandboxed, when the servers file disabled its sandbox.
    unsandboxed: str | None = None
    #: The MCP session and JSON-RPC request id of the call (worker/request_ids.py).
    request: dict[str, Any] = field(default_factory=dict)
    #: The MCP Task the call ran as: its id, statuses, request ids (worker/mcp_tasks.py).
    task: dict[str, Any] | None = None


@dataclass(frozen=True)
class Classification:
    outcome: Outcome
    reason_code: str
    values: dict[str, Any] | None = None
    operation_id: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


def _error_summary(error: BaseException) -> dict[str, Any]:
    summary: dict[str, Any] = {"type": type(error).__name__, "message": str(error)[:500]}
    code = getattr(getattr(error, "error", None), "code", None) or getattr(error, "code", None)
    if isinstance(code, int):
        summary["code"] = code
    if isinstance(error, BaseExceptionGroup):
        summary["inner"] = [_error_summary(e) for e in error.exceptions[:5]]
    return summary


def _tool_error_class(result: Any, class_field: str) -> str | None:
    data = getattr(result, "structured_content", None)
    if isinstance(data, dict) and isinstance(data.get(class_field), str):
        return data[class_field]
    text = "".join(getattr(b, "text", "") for b in getattr(result, "content", []) or [])
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser: no class to read
        return None
    if isinstance(parsed, dict) and isinstance(parsed.get(class_field), str):
        return parsed[class_field]
    return None


def classify(report: CallReport, contract: Contract, limit: int | None = None) -> Classification:
    if not report.sent:
        # No OAuth token could be had before the request (worker/oauth.py), or no per-action token
        # was granted or accepted (worker/token_exchange.py): each its own reason.
        reason = report.error.code if isinstance(report.error, ServerAuthFailed | TokenExchangeRefused) \
            else "not_sent"
        return Classification(Outcome.failed_before_side_effect, reason,
                              evidence={"error": _error_summary(report.error) if report.error else None})
    if report.error is not None:
        summary = _error_summary(report.error)
        if type(report.error).__name__ == "CallCancelled":
            # We cancelled it on an operator's request; the server may or may not have stopped.
            return Classification(Outcome.unknown_outcome, "cancelled_in_flight", evidence={"error": summary})
        if summary.get("code") == MESSAGE_TOO_LARGE:
            # The transport stopped reading an oversize answer: sent, and whatever it did is unknown.
            data = getattr(getattr(report.error, "error", None), "data", None) or {}
            return Classification(Outcome.unknown_outcome, ResultTooLarge.code, evidence={
                "error": summary, "result_size": data.get("size"), "result_digest": data.get("sha256"),
                "result_limit": data.get("limit"), "result_excerpt": str(data.get("excerpt", ""))[:1024],
                "read_by": "transport"})
        if isinstance(report.error, SandboxAuditOverflow):
            # The call was sent and may have acted; the audit of what the server tried is incomplete.
            return Classification(Outcome.unknown_outcome, report.error.code,
                                  evidence={"error": summary, **report.error.as_evidence()})
        if isinstance(report.error, McpTaskExpired):
            # The task can no longer say what it did; it was created, so it may have acted.
            return Classification(Outcome.unknown_outcome, report.error.code,
                                  evidence={"error": summary, **report.error.as_evidence()})
        if isinstance(report.error, AbsoluteDeadlineReached):
            # However much progress the server reported, the deadline held; it may have acted.
            return Classification(Outcome.unknown_outcome, report.error.code,
                                  evidence={"error": summary, **report.error.as_evidence()})
        if refused_by_runtime(report.error):
            # The runtime refused what the server asked for mid-call; the server had the call and,
            # whatever its InputRequiredResult claimed, only a read can say what it did.
            return Classification(Outcome.unknown_outcome, "server_request_refused", evidence={"error": summary})
        if summary.get("code") in REFUSED_BEFORE_RUNNING:
            return Classification(Outcome.failed_before_side_effect, "protocol_refused", evidence={"error": summary})
        return Classification(Outcome.unknown_outcome, "response_lost", evidence={"error": summary})

    result = report.result
    if limit is not None:
        payload = measure(result)
        if payload.size > limit:
            exc = ResultTooLarge(f"the result is {payload.size} bytes; the limit is {limit}")
            return Classification(Outcome.unknown_outcome, exc.code,
                                  evidence={**exc.as_evidence(), **payload.as_evidence(limit)})
    if getattr(result, "is_error", False):
        error_class = _tool_error_class(result, contract.tool_errors.class_field)
        mapped = contract.tool_errors.classes.get(error_class or "", contract.tool_errors.default)
        text = "".join(getattr(b, "text", "") for b in getattr(result, "content", []) or [])
        return Classification(Outcome(mapped), f"tool_error:{error_class or 'unclassified'}",
                              evidence={"error_class": error_class, "text": text[:500]})

    try:
        values = extract(result, contract.result)
    except ExtractionFailed as exc:
        # The tool ran and answered something we cannot read: whatever it did is not known.
        return Classification(Outcome.unknown_outcome, exc.code, evidence=exc.as_evidence())
    operation_id = None
    if contract.operation_id:
        try:
            operation_id = evaluate(contract.operation_id, {"result": values}, contract.compiled())
        except ConditionError as exc:
            return Classification(Outcome.unknown_outcome, "operation_id_missing", values=values,
                                  evidence=exc.as_evidence())
    if contract.asynchronous:
        return Classification(Outcome.accepted, "accepted", values=values,
                              operation_id=str(operation_id) if operation_id is not None else None)
    return Classification(Outcome.completed_unverified, "tool_reported_success", values=values,
                          operation_id=str(operation_id) if operation_id is not None else None)
