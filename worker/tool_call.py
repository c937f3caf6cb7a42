"""The tool call itself: sent under a live lease, heartbeating, every failure kept for the classifier.

Whether a failed request was sent decides everything after it (a request that never left is a
failure before any side effect; one that left may have changed the world), so :func:`_sent` says
False only when the failure proves the request never left.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

from proofline.contracts import Contract
from proofline.envelope import Envelope
from proofline.errors import (
    McpTaskExpired,
    McpUnavailable,
    SandboxAuditOverflow,
    StaleLease,
    TokenExchangeRefused,
)
from proofline.telemetry import tracing
from worker import calls, faultpoints, mcp_tasks
from worker.classify import CallReport
from worker.lease import Heartbeat
from worker.mcp_client import CancelHandle
from worker.runtime import Runtime
from worker.servers import Server


def _sent(exc: BaseException) -> bool:
    """False only when the failure proves the request never left (connection refused or not opened,
    or no per-action token to send it with)."""
    if isinstance(exc, SandboxAuditOverflow):
        return exc.sent  # it says itself whether it stopped the call before or after sending
    if isinstance(exc, McpUnavailable | ConnectionRefusedError | TokenExchangeRefused):
        return False
    if type(exc).__name__ == "ConnectError":
        return False
    if isinstance(exc, BaseExceptionGroup):
        return any(_sent(e) for e in exc.exceptions)
    cause = exc.__cause__ or exc.__context__
    return _sent(cause) if cause is not None and cause is not exc else True


def call_tool(rt: Runtime, server: Server, envelope: Envelope, contract: Contract, token: int, db_now, t0: float,
              plan_meta: dict[str, str] | None = None) -> CallReport:
    """The write call. ``plan_meta`` names the approved plan (``proofline/plan_hash``, ``proofline/plan_id``)
    in the request's ``_meta`` when the action was approved by plan, so the server can hold the
    commit to the plan it prepared."""
    settings = rt.settings
    remaining = (envelope.deadline - db_now).total_seconds() - (time.monotonic() - t0)
    deadline_monotonic = time.monotonic() + remaining
    timeout = min(envelope.timeout_seconds, contract.timeout_seconds)
    progress = calls.ProgressLog(limit=settings.progress_events_limit)
    started = time.monotonic()
    handle = CancelHandle()
    unsandboxed = rt.mcp.unsandboxed_reason(server, "write")
    # A contract that asks for an MCP Task gets one where the server advertises Tasks (worker/mcp_tasks.py).
    try:
        task = mcp_tasks.TaskLog(settings.progress_events_limit) if contract.mcp_task is not None and \
            mcp_tasks.advertised(rt.mcp.negotiated(server).capabilities) else None
    except McpUnavailable as exc:  # the session died since revalidation: nothing was sent
        return CallReport(sent=False, error=exc, unsandboxed=unsandboxed)
    # A per-action token where the identity's auth block asks for one (worker/token_exchange.py);
    # refused or not granted, nothing is sent.
    narrowed = ExitStack()
    try:
        narrowed.enter_context(rt.mcp.exchanged_token(server, "write", envelope.tool.name,
                                                      remaining - (time.monotonic() - started)))
    except (TokenExchangeRefused, McpUnavailable) as exc:
        return CallReport(sent=False, error=exc, unsandboxed=unsandboxed)
    with narrowed, Heartbeat(rt.conn, envelope.action_id, token, settings.lease_ttl_seconds,
                             settings.heartbeat_seconds, touch=rt.touch, on_cancel=handle.cancel) as heartbeat:
        if not heartbeat.valid():
            # Frozen or slow past the lease: someone else may already be reconciling. Do not send.
            return CallReport(sent=False, error=StaleLease("lease lapsed before the request was sent"))
        faultpoints.hit("before_send", envelope.action_id)
        try:
            trace_meta = {**tracing.carrier(), **(plan_meta or {})}  # read here: the call runs on the session's thread
            if task is not None:
                assert contract.mcp_task is not None
                result, elapsed, request = mcp_tasks.call(
                    rt, server, action_id=envelope.action_id, tool=envelope.tool.name, arguments=envelope.arguments,
                    meta=mcp_tasks.meta_for(envelope.idempotency_key, envelope.action_id, token, trace_meta),
                    policy=contract.mcp_task, timeout=timeout, deadline_monotonic=deadline_monotonic, log=task,
                    cancel_handle=handle)
                faultpoints.hit("after_send", envelope.action_id)
                return CallReport(sent=True, result=result, elapsed_seconds=elapsed, progress=tuple(progress.kept),
                                  progress_total=progress.total, unsandboxed=unsandboxed, request=request,
                                  task=task.evidence())
            result, elapsed = rt.mcp.run(server, "write", lambda c: calls.call_tool(  # type: ignore[arg-type]
                c, tool=envelope.tool.name, arguments=envelope.arguments, idempotency_key=envelope.idempotency_key,
                action_id=envelope.action_id, timeout_seconds=timeout, deadline_monotonic=deadline_monotonic,
                progress=progress, fencing_token=token, trace_meta=trace_meta), cancel_handle=handle)
        except BaseException as exc:  # noqa: BLE001 - every failure is classified, none escapes unrecorded
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            request = rt.mcp.last_request  # before discard: the ids minted on the session that broke
            if task is not None and task.task_id is not None:
                # A task exists, so the call was sent; its ids are the tools/call's (none when this
                # delivery resumed it), the polls' are in the task's evidence.
                request = {} if task.resumed else {k: v for k, v in task.created.items() if k.startswith("mcp_")}
            sent = _sent(exc) or (task is not None and task.task_id is not None)
            # A session that broke mid-call is dropped; if a sandbox limit killed its server, that is
            # evidence on this action.
            # (An expired task is an answer on a healthy session: it stays.)
            violation = rt.mcp.discard(server, "write") if sent and not isinstance(exc, McpTaskExpired) else None
            return CallReport(sent=sent, error=exc, elapsed_seconds=time.monotonic() - started,
                              progress=tuple(progress.kept), progress_total=progress.total,
                              sandbox_violation=violation, unsandboxed=unsandboxed, request=request,
                              task=task.evidence() if task is not None else None)
    faultpoints.hit("after_send", envelope.action_id)
    return CallReport(sent=True, result=result, elapsed_seconds=elapsed, progress=tuple(progress.kept),
                      progress_total=progress.total, unsandboxed=unsandboxed, request=rt.mcp.last_request)
