"""The downstream operation's own status record, read once when verification starts.

An asynchronous tool hands back an operation id; the downstream keeps a status record under it (a
job status API, an MCP Task) for a time to live of its own choosing. Verification reads that
record first, as evidence of what the downstream says it did, and then settles the action from the
authoritative read alone. A record that is gone by then (expired before the runtime retrieved it)
is recorded as ``operation_record_expired``: the ledger keeps the fact that this evidence was lost.
"""

from __future__ import annotations

from typing import Any

from proofline.conditions import build_arguments, holds
from proofline.contracts import Contract, extract
from proofline.envelope import Envelope
from proofline.errors import ConditionError, OperationRecordExpired
from worker import calls
from worker.runtime import Runtime


def read_operation_record(rt: Runtime, envelope: Envelope, contract: Contract,
                          base: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Returns (evidence for ``verification_finished``, evidence of an expired record or None).
    Nothing here decides the verdict; a failed read is recorded and verification goes on."""
    spec = contract.verification.operation_record
    if spec is None:
        return None, None
    try:
        arguments = build_arguments(spec.arguments, base)
    except ConditionError as exc:
        # No operation id to ask about (the accepting response was lost): nothing to retrieve.
        return {"read_tool": spec.tool, "retrieved": False, "reason": exc.code}, None
    server = rt.server(envelope.server.name)
    try:
        result = rt.mcp.run(server, "read", lambda c: calls.read_tool(  # type: ignore[arg-type]
            c, tool=spec.tool, arguments=arguments, timeout_seconds=contract.timeout_seconds))
        if getattr(result, "is_error", False):
            text = "".join(getattr(b, "text", "") for b in result.content or [])
            return {"read_tool": spec.tool, "arguments": arguments, "retrieved": False, "error": text[:300]}, None
        record = extract(result, spec.extract)
    except BaseException as exc:  # noqa: BLE001 - evidence only: an unreadable record is noted, never fatal
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        return {"read_tool": spec.tool, "arguments": arguments, "retrieved": False, "error": repr(exc)[:300]}, None
    try:
        gone = holds(spec.gone, {**base, "operation": record})
    except ConditionError:
        gone = False
    evidence = {"read_tool": spec.tool, "arguments": arguments, "retrieved": not gone, "record": record}
    if not gone:
        return evidence, None
    expired = OperationRecordExpired(
        f"the downstream no longer serves the record of operation {next(iter(arguments.values()), '?')}; "
        "the outcome is settled from the authoritative read alone", read_tool=spec.tool)
    return evidence, {**expired.as_evidence(), "arguments": arguments, "record": record}
