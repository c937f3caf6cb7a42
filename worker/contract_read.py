"""The worker's side of a gateway read (``proofline.read``, see ``proofline/reads.py``).

The task's body is refused unless a controller key signed it and it is exactly the request the
controller recorded in the ledger: broker access alone can neither ask for a read nor change whose
read it is. The read is the contract's precondition read, built from the target only and made
through the server's read identity; its answer counts as the tenant's only when the contract's
tenant preconditions hold over it. A refused task writes nothing (it may not be anyone's request);
an accepted one is answered once, on the request's chain.
"""

from __future__ import annotations

import logging
from typing import Any

from ledger import reads as read_store
from ledger import store
from ledger.redact import for_envelope
from proofline.conditions import build_arguments, holds
from proofline.contracts import extract
from proofline.errors import McpUnavailable, ProoflineError, ReadRefused, ResultTooLarge
from proofline.keys import load_keyring
from proofline.reads import NOT_FOUND, UNAVAILABLE, offers_read, tenant_conditions, verify_request
from worker import calls
from worker.results import measure, result_limit
from worker.runtime import Runtime

log = logging.getLogger(__name__)


def answer_read(rt: Runtime, message: Any) -> dict[str, Any]:
    """Verify one read task, make the read, record its answer; what happened, for the task's log line."""
    try:
        request, key = verify_request(message, load_keyring(rt.settings.keyring_file, rt.settings.environment))
        request_id = str(request.get("request_id", ""))
        with store.transaction(rt.conn) as cur:
            recorded = read_store.state(cur, request_id)
        if not read_store.is_recorded(recorded["request"], request):
            raise ReadRefused(f"read {request_id[:64]!r} is not a request the ledger recorded", cause="not_recorded")
        if recorded["answer"] is not None:
            return {"status": "skipped", "request_id": request_id, "reason_code": "answered"}
    except ReadRefused as exc:
        log.warning("read task refused", extra={"event": "read_refused", "reason_code": exc.code,
                                                "cause": exc.context.get("cause")})
        return {"status": "refused", "reason_code": exc.code, "cause": exc.context.get("cause")}
    answer = _read(rt, request)
    answer["signed_by"] = key.key_id
    with store.transaction(rt.conn) as cur:
        read_store.answer_txn(cur, request_id, answer, rt.settings.worker_id)
    log.info("read answered", extra={"event": "read_answered", "request_id": request_id,
                                     "reason_code": answer.get("refused") or "found"})
    return {"status": "answered", "request_id": request_id, "found": answer["found"]}


def _read(rt: Runtime, request: dict[str, Any]) -> dict[str, Any]:
    """The answer to a verified request: the redacted value, or why there is none."""
    try:
        contract = rt.contract(str(request["action_type"]))
    except ProoflineError as exc:
        return {"found": False, "refused": "read_not_offered", "reason_code": exc.code}
    try:
        if not offers_read(contract):
            return {"found": False, "refused": "read_not_offered"}
        server = rt.server(contract.server)
        read = contract.precondition_read
        target = {"type": contract.target_type, "id": str(request["target"]["id"])}
        compiled = contract.compiled()
        arguments = build_arguments(read.arguments, {"target": target}, compiled)
        rt.mcp.action_id = None
        result = rt.mcp.run(server, "read", lambda c: calls.read_tool(
            c, tool=read.tool, arguments=arguments, timeout_seconds=contract.timeout_seconds))
        limit = result_limit(rt.settings, server, contract)
        if measure(result).size > limit:
            raise ResultTooLarge(f"read tool {read.tool} answered more than {limit} bytes")
        if getattr(result, "is_error", False):
            raise McpUnavailable(f"read tool {read.tool} answered an error")
        before = extract(result, read.extract)
    except ProoflineError as exc:
        return {"found": False, "refused": UNAVAILABLE, "reason_code": exc.code}
    except Exception as exc:  # noqa: BLE001 - an unreadable system answers "unavailable", never a value
        rt.mcp.discard(rt.server(contract.server), "read")
        return {"found": False, "refused": UNAVAILABLE, "reason_code": type(exc).__name__}
    variables = {"before": before, "target": target, "envelope": {"tenant": request["tenant"]}}
    for condition in tenant_conditions(contract):
        try:
            ours = holds(condition.expr, variables, compiled)
        except ProoflineError:
            ours = False
        if not ours:  # another tenant's, or nobody's: the same answer, so nothing is learned
            return {"found": False, "refused": NOT_FOUND}
    red = for_envelope({}, contract.sensitive_fields)
    return {"found": True, "value": red(before), "read": {"server": contract.server, "tool": read.tool},
            "contract": {"action_type": contract.action_type, "version": contract.version}}
