"""Preflight: what the worker reads and checks before it may call a tool.

The live tool contract (for revalidation), the authoritative read of the target, the contract's
preconditions on that fresh read, and the rules of points of no return.
"""

from __future__ import annotations

from typing import Any

from proofline.conditions import Variables, build_arguments, holds
from proofline.contracts import Contract, ReadPath, extract
from proofline.envelope import Envelope
from proofline.errors import (
    ConditionError,
    McpUnavailable,
    RevalidationFailed,
    TargetReadFailed,
    ToolContractChanged,
)
from proofline.pins import negotiation_changes, pins_path, read_pins
from worker import calls
from worker.results import measure, result_limit
from worker.runtime import Runtime
from worker.servers import Server
from worker.validate import revalidate_live


def envelope_variables(envelope: Envelope, **extra: Any) -> dict[str, Any]:
    """What CEL sees of an envelope: ``envelope``, ``args``, ``target`` and any ``extra`` names."""
    doc = envelope.model_dump(mode="json")
    return {"envelope": doc, "args": doc["arguments"], "target": doc["target"], **extra}


def live_negotiation(rt: Runtime, server: Server) -> dict[str, Any]:
    """The protocol version and capabilities this process's session with ``server`` negotiated,
    compared with what ``contracts pin`` recorded for it: a difference is not the reviewed server
    (``tool_contract_changed`` naming each change). A pin that recorded no negotiation, or no pin
    (an envelope bound to a live description), compares nothing."""
    live = rt.mcp.negotiated(server)
    pin = read_pins(pins_path(rt.settings)).get(server.name)
    changes = negotiation_changes(pin, live)
    if changes:
        raise ToolContractChanged(f"server {server.name} is not as pinned: {'; '.join(changes)}"[:1000],
                                  server=server.name, changes=changes[:20])
    return {"protocol_version": live.protocol_version, "pinned": bool(pin and pin.protocol_version)}


def read_target(rt: Runtime, server: Server, contract: Contract, envelope: Envelope, role: str = "write") -> dict[str, Any]:
    """One authoritative read through the contract's precondition read path."""
    path = contract.precondition_read
    try:
        arguments = build_arguments(path.arguments, envelope_variables(envelope), contract.compiled())
    except Exception as exc:  # noqa: BLE001 - the read cannot even be asked for: no snapshot
        raise TargetReadFailed(f"read {path.tool} arguments could not be built: {str(exc)[:300]}") from None
    return read_through(rt, server, contract, path, arguments, role)


def read_through(rt: Runtime, server: Server, contract: Contract, path: ReadPath, arguments: dict[str, Any],
                 role: str, failed: type[TargetReadFailed] = TargetReadFailed) -> dict[str, Any]:
    """Call a read tool and extract its answer, bounded by the result limit. Every way it can go
    wrong (the call, an error result, a result too large or unreadable) raises ``failed``: a
    retryable refusal before any side effect, its cause recorded."""
    try:
        result = rt.mcp.run(server, role, lambda c: calls.read_tool(  # type: ignore[arg-type]
            c, tool=path.tool, arguments=arguments, timeout_seconds=contract.timeout_seconds))
    except McpUnavailable:
        raise
    except BaseException as exc:  # noqa: BLE001 - any read failure means "no fresh snapshot"
        violation = rt.mcp.discard(server, role)  # type: ignore[arg-type]
        raise failed(f"read {path.tool} failed: {exc!r}"[:500],
                     **({"sandbox_violation": violation} if violation else {})) from None
    limit = result_limit(rt.settings, server, contract)
    size = measure(result).size
    if size > limit:
        raise failed(f"read {path.tool} returned {size} bytes; the limit is {limit}")
    if getattr(result, "is_error", False):
        text = "".join(getattr(b, "text", "") for b in result.content or [])
        raise failed(f"read {path.tool} returned an error: {text[:300]}")
    try:
        return extract(result, path.extract)
    except Exception as exc:  # noqa: BLE001 - a result the contract cannot read is no fresh snapshot either
        # Inside the read's own error handling: an unreadable read is a target_read_failed with its
        # cause (recorded, retried while the deadline allows), never an unexpected task failure.
        raise failed(f"read {path.tool} returned a result the contract cannot read: "
                     f"{getattr(exc, 'code', type(exc).__name__)}: {str(exc)[:300]}", unreadable=True) from None


def live_contract(rt: Runtime, server: Server, fresh: bool = False) -> tuple[str | None, dict[str, str], bool]:
    """The live server version and tool hashes (the session's tool list while it is valid: see
    worker/tool_list.py, or listed now when ``fresh``), and whether the list came from the cache.
    Listing tools has no side effect, so a session that turns out to be dead is replaced and asked
    once more before giving up."""
    max_age = 0.0 if fresh else server.tool_list_max_age_seconds
    if max_age is None:
        max_age = rt.settings.tool_list_max_age_seconds
    for attempt in (1, 2):
        try:
            version = rt.mcp.server_version(server)
            hashes, miss = rt.mcp.tool_hashes(server, max_age)
            return version, hashes, miss is None
        except McpUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken session, reported as unavailable
            rt.mcp.discard(server, "write")
            if attempt == 2:
                raise McpUnavailable(f"tools/list on {server.name} failed: {exc!r}"[:500]) from None
    raise AssertionError("unreachable")


def revalidated_contract(rt: Runtime, server: Server, envelope: Envelope) -> tuple[dict[str, str], dict[str, Any]]:
    """The live tool hashes and the revalidation's evidence (``worker/validate.py``). A mismatch
    found on the session's cached list is checked against a fresh list before it refuses the
    action: the session may belong to a server that has exited or restarted since, which the worker
    notices only at the session's next request."""
    version, hashes, cached = live_contract(rt, server)
    try:
        return hashes, revalidate_live(envelope, version, server.expected_version, hashes)
    except RevalidationFailed:
        if not cached:
            raise
    version, hashes, _ = live_contract(rt, server, fresh=True)
    return hashes, revalidate_live(envelope, version, server.expected_version, hashes)


def check_preconditions(contract: Contract, envelope: Envelope, before: dict[str, Any]) -> list[dict[str, str]]:
    """Evaluate every precondition; a condition that cannot be evaluated has failed."""
    variables = Variables(envelope_variables(envelope, before=before))  # converted to CEL once for every condition
    compiled = contract.compiled()
    failures = []
    conditions = [(c.name, c.expr, c.reason) for c in contract.preconditions]
    conditions += [(f"envelope[{i}]", expr, "precondition_failed") for i, expr in enumerate(envelope.preconditions)]
    for name, expr, reason in conditions:
        try:
            ok = holds(expr, variables, compiled)
        except ConditionError as exc:
            ok, reason = False, exc.code
        if not ok:
            failures.append({"name": name, "expr": expr, "reason": reason})
    return failures


def check_point_of_no_return(conn: Any, envelope: Envelope, legacy: bool = True) -> dict[str, Any]:
    """A point of no return (the contract's, or the envelope's flag) runs only with an approval
    that covers irreversibility, as the last step of its run, and only after every earlier step is
    verified. Under an authority policy the signed approvals prove the coverage
    (``worker/authorize.py``); without one (``legacy``) the controller's approval context must say so."""
    from proofline.errors import PointOfNoReturnRefused

    if legacy and not envelope.approval.covers_irreversible:
        raise PointOfNoReturnRefused("the approval does not cover an irreversible action",
                                     compensation="not available")
    if envelope.step != envelope.run_steps - 1:
        raise PointOfNoReturnRefused(f"irreversible step {envelope.step} is not the last of {envelope.run_steps}",
                                     compensation="not available")
    with conn.cursor() as cur:
        cur.execute("""SELECT action_id, status, outcome FROM actions WHERE run_id = %s AND step < %s
                       AND NOT (status = 'closed' AND outcome = 'completed_verified')""",
                    (envelope.run_id, envelope.step))
        unverified = [r["action_id"] for r in cur.fetchall()]
    if unverified:
        raise PointOfNoReturnRefused(f"earlier steps are not verified: {', '.join(unverified)}",
                                     compensation="not available")
    return {"covers_irreversible": True, "earlier_steps_verified": envelope.step, "compensation": "not available"}
