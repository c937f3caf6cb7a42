"""Prepare: ask the system of record for the plan of an action, through the read identity.

The same call serves both moments of an approved write: before approval (the plan an approver
reviews and whose hash the approval names) and right before the commit call, where the fresh plan
is compared with the approved one (``proofline.plan.check_plan``, ``plan_changed``). Nothing here
writes: the prepare tool runs on the server's read identity, whatever its annotations claim.
"""

from __future__ import annotations

from typing import Any

from proofline.conditions import Variables, build_arguments, evaluate
from proofline.contracts import Contract, Prepare
from proofline.envelope import Envelope
from proofline.errors import ConditionError, PrepareFailed, TargetReadFailed
from proofline.plan import Plan, PlanSource, new_plan
from worker.preflight import envelope_variables, read_target, read_through
from worker.runtime import Runtime
from worker.servers import Server

#: The identity every prepare runs as: the servers file requires one for every server.
ROLE = "read"


def make_plan(rt: Runtime, server: Server, contract: Contract, envelope: Envelope) -> Plan:
    """The plan for ``envelope`` as the system of record sees it now.

    With a ``prepare:`` block: the prepare tool's extracted answer, its plan id and target version
    (the contract's CEL over ``plan``). Without one: the precondition read's snapshot and the
    arguments. Raises ``prepare_failed`` (retryable) when the prepare call or its answer fails,
    ``target_read_failed`` (retryable) when the precondition read does, and a ``ConditionError``
    (terminal) when the prepare tool's arguments cannot be built from the envelope."""
    if contract.prepare is None:
        before = read_target(rt, server, contract, envelope, role=ROLE)
        content = {"read": contract.precondition_read.tool, "before": before, "arguments": envelope.arguments}
        return _hashed(TargetReadFailed, contract.precondition_read.tool, PlanSource.precondition_snapshot, content,
                       arguments_hash=envelope.arguments_hash)
    prepare = contract.prepare
    compiled = contract.compiled()
    try:
        arguments = build_arguments(prepare.arguments, envelope_variables(envelope), compiled)
    except ConditionError as exc:
        # The contract's mapping does not fit this envelope: asking again cannot help.
        raise type(exc)(f"prepare {prepare.tool} arguments could not be built: {exc.detail}"[:500],
                        **exc.context) from None
    content = read_through(rt, server, contract, prepare, arguments, ROLE, failed=PrepareFailed)
    plan_id, target_version = _labels(prepare, Variables(envelope_variables(envelope, plan=content)), compiled)
    return _hashed(PrepareFailed, prepare.tool, PlanSource.prepare_tool, content,
                   arguments_hash=envelope.arguments_hash, plan_id=plan_id, target_version=target_version)


def _hashed(failed: type[TargetReadFailed], tool: str, source: PlanSource, content: dict[str, Any],
            **fields: Any) -> Plan:
    """The plan with its hash. The content is the server's JSON: a value canonical JSON cannot write
    (an integer beyond 2**53, NaN) makes no plan anyone could approve by hash."""
    try:
        return new_plan(source, content, **fields)
    except ValueError as exc:
        raise failed(f"read {tool} returned a plan that cannot be hashed: {str(exc)[:300]}", unreadable=True) from None


def _labels(prepare: Prepare, variables: Variables, compiled: Any) -> tuple[str | None, Any]:
    """The plan id and target version the contract reads out of the plan. The plan is the server's
    answer: one that lacks them, or gives them in a shape no version has, is no usable plan."""
    found: dict[str, Any] = {}
    for name, expr in (("plan_id", prepare.plan_id), ("target_version", prepare.target_version)):
        if expr is None:
            found[name] = None
            continue
        try:
            value = evaluate(expr, variables, compiled)
        except ConditionError as exc:
            raise PrepareFailed(f"prepare {prepare.tool}: {name} could not be read from the plan: {exc.detail}"[:500],
                                unreadable=True) from None
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | str)):
            raise PrepareFailed(f"prepare {prepare.tool}: {name} is {type(value).__name__}, not a string or an "
                                f"integer", unreadable=True)
        found[name] = value
    plan_id = found["plan_id"]
    return (str(plan_id) if plan_id is not None else None), found["target_version"]
