"""Reading the system of record for a verdict: one read judged against the contract's expected,
tolerated and prohibited outcomes, and the polling loop around it. Used by the verification task
(``recovery/verify.py``) and by the execute task's first read when it can decide at once
(``worker/inline_verify.py``). Lack of evidence is never success.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ledger.redact import Redactor
from ledger.states import Outcome, VerificationFinding
from proofline.conditions import CompiledConditions, Variables, build_arguments, holds
from proofline.contracts import Contract, ReadPath, Verification, extract
from proofline.envelope import Envelope
from proofline.errors import ConditionError, McpUnavailable, ProoflineError, ResultTooLarge
from proofline.telemetry import tracing
from worker import calls
from worker.classify import Classification
from worker.lease import Heartbeat
from worker.record_call import FirstRead, verification_key
from worker.results import measure, result_limit
from worker.runtime import Runtime
from worker.servers import Server

READS_KEPT = 5
#: Request ids kept per observation (one per read; a long poll keeps its first ones).
REQUESTS_KEPT = 50


@dataclass
class Observation:
    finding: VerificationFinding
    after: dict[str, Any] | None = None
    reads: int = 0
    failed_reads: int = 0
    last_error: str | None = None
    kept: list[dict[str, Any]] = field(default_factory=list)
    #: Conditions that could not be evaluated (recorded, bounded): they counted as not holding.
    condition_errors: list[dict[str, str]] = field(default_factory=list)
    #: The execute task's first read only: the ``before`` snapshot as the ledger stores it.
    before: Any = None
    #: The MCP session of the reads and the JSON-RPC request id of each (worker/request_ids.py).
    mcp_connection: str | None = None
    request_ids: list[int] = field(default_factory=list)

    def requests(self) -> dict[str, Any]:
        """What a read's evidence records of the requests it sent (bounded like the timeline)."""
        return {"mcp_connection": self.mcp_connection, "mcp_request_ids": self.request_ids} if self.mcp_connection else {}

    def sent(self, request: dict[str, Any]) -> dict[str, Any]:
        """Note one read's request (``McpSessions.last_request``); returns it for the timeline."""
        if "mcp_connection" in request:
            self.mcp_connection = request["mcp_connection"]
        rid = request.get("mcp_request_id")
        if rid is not None and len(self.request_ids) < REQUESTS_KEPT:
            self.request_ids.append(rid)
        return {"mcp_request_id": rid} if rid is not None else {}


def judge(verification: Verification, variables: dict[str, Any], *, settled: bool,
          errors: list[dict[str, str]] | None = None, compiled: CompiledConditions | None = None) -> VerificationFinding:
    """Evaluate one read. ``settled`` is true once the expected consistency delay has passed.

    Prohibited wins over everything; expected needs every condition true; a condition that cannot
    be evaluated counts as not holding, never as holding.
    """

    bound = Variables(variables)  # converted to CEL once for every condition of this read

    def true(expr: str) -> bool:
        try:
            return holds(expr, bound, compiled)
        except ConditionError as exc:
            if errors is not None and len(errors) < READS_KEPT:
                errors.append({"expr": expr[:200], "reason_code": exc.code, "detail": exc.detail[:300]})
            return False

    if any(true(expr) for expr in verification.prohibited):
        return VerificationFinding.prohibited
    if all(true(expr) for expr in verification.expected):
        return VerificationFinding.expected
    if verification.tolerated and any(true(expr) for expr in verification.tolerated):
        return VerificationFinding.tolerated
    if settled and verification.absent and true(verification.absent):
        return VerificationFinding.absent
    return VerificationFinding.not_reached


def observe(rt: Runtime, envelope: Envelope, contract: Contract, base: dict[str, Any],
            max_reads: int | None = None) -> Observation:
    """Poll the read path until a decisive finding or the bound; ``max_reads``: stop after that many
    attempts (answered or not) with the last finding, ``not_reached`` or ``unavailable``."""
    v = contract.verification
    if envelope.expected_postconditions:
        # The controller's extra post-conditions must hold too (checked against the limits at revalidation).
        v = v.model_copy(update={"expected": (*v.expected, *envelope.expected_postconditions)})
    return poll(rt, rt.server(envelope.server.name), contract, contract.verification_read, v, base, max_reads)


def poll(rt: Runtime, server: Server, contract: Contract, read: ReadPath, v: Verification, base: dict[str, Any],
         max_reads: int | None = None) -> Observation:
    """Poll one read path on ``server`` (through its read identity) judged by ``v``'s conditions."""
    started = time.monotonic()
    bound = started + v.max_duration_seconds
    obs = Observation(VerificationFinding.unavailable)
    limit = result_limit(rt.settings, server, contract)
    compiled = contract.compiled()
    while True:
        settled = time.monotonic() - started >= v.consistency_delay_seconds
        rt.mcp.last_request = {}
        try:
            arguments = build_arguments(read.arguments, base, compiled)
            with tracing.span("proofline.verification_read", **{"proofline.tool": read.tool}):
                trace_meta = tracing.carrier()
                result = rt.mcp.run(server, "read", lambda c, a=arguments, m=trace_meta: calls.read_tool(  # type: ignore[arg-type]
                    c, tool=read.tool, arguments=a, timeout_seconds=contract.timeout_seconds, trace_meta=m))
            size = measure(result).size
            if size > limit:
                raise ResultTooLarge(f"read tool {read.tool} answered {size} bytes; the limit is {limit}")
            if getattr(result, "is_error", False):
                text = "".join(getattr(b, "text", "") for b in result.content or [])
                raise McpUnavailable(f"read tool {read.tool} answered an error: {text[:200]}")
            after = extract(result, read.extract)
        except BaseException as exc:  # noqa: BLE001 - an unreadable system is "unavailable", not success
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            if not isinstance(exc, ProoflineError):
                rt.mcp.discard(server, "read")
            obs.sent(rt.mcp.last_request)
            obs.failed_reads += 1
            obs.last_error = repr(exc)[:300]
            finding = None
        else:
            request = obs.sent(rt.mcp.last_request)
            obs.reads += 1
            obs.after = after
            finding = judge(v, {**base, "after": after}, settled=settled, errors=obs.condition_errors,
                            compiled=compiled)
            if len(obs.kept) < READS_KEPT or finding != VerificationFinding.tolerated:
                obs.kept.append({"t_ms": round((time.monotonic() - started) * 1000), "finding": finding.value,
                                 **request})
            if finding in (VerificationFinding.expected, VerificationFinding.prohibited, VerificationFinding.absent):
                obs.finding = finding
                return obs
        if max_reads is not None and obs.reads + obs.failed_reads >= max_reads:
            obs.finding = finding or VerificationFinding.unavailable
            return obs
        if time.monotonic() + v.poll_interval_seconds > bound and (settled or not obs.reads):
            # The bound passed: a read path that never answered is "unavailable"; one that answered
            # but never showed the expected state is "not reached". A path that answered only
            # before its consistency delay had passed (a slow first read: a server starting) is
            # read once more after it, so that its lag is never taken for the verdict.
            obs.finding = VerificationFinding.not_reached if obs.reads else VerificationFinding.unavailable
            return obs
        time.sleep(v.poll_interval_seconds)


def finding_evidence(envelope: Envelope, contract: Contract, obs: Observation,
                     prior: Outcome | None) -> dict[str, Any]:
    """What ``verification_finished`` records of the reads, whichever task made them."""
    evidence: dict[str, Any] = {
        "verification_key": verification_key(envelope), "finding": obs.finding.value, "reads": obs.reads,
        "failed_reads": obs.failed_reads, "last_error": obs.last_error, "timeline": obs.kept,
        "after": obs.after, "prior_outcome": prior.value if prior else None,
        "read_tool": contract.verification_read.tool, "identity": "read", **obs.requests(),
    }
    if obs.condition_errors:
        evidence["condition_errors"] = obs.condition_errors
    return evidence


def decides_in_place(settings: Any, verdict: Any, contract: Contract | None = None) -> bool:
    """Whether the execute task may read for the verdict itself, right after the call: only a call
    the server reported complete, with values (a lost or empty answer is recovered by the
    verification task), no downstream operation to follow, and no independent evidence sources to
    wait for (those are read by the verification task). Anything the first read does not prove
    ``expected`` goes to the verification task as before."""
    return (settings.inline_verification and verdict.outcome == Outcome.completed_unverified
            and bool(verdict.values) and verdict.operation_id is None and not (contract is not None and contract.verification.sources))


def first_read(rt: Runtime, envelope: Envelope, contract: Contract, doc: dict[str, Any], before: dict[str, Any],
               values: dict[str, Any], stored: Any) -> Observation:
    """One read of the system of record through the read identity, judged as the verification
    task's first read would be: ``before`` and the result's ``values`` as the ledger stores them
    (``stored`` is the action's redactor), the envelope as signed."""
    kept = stored({"before": before})["before"]
    base = {"envelope": doc, "args": doc["arguments"], "target": doc["target"], "before": kept or {},
            "result": stored({"values": values})["values"] or {}}
    obs = observe(rt, envelope, contract, base, max_reads=1)
    obs.before = kept
    return obs


def read_in_place(rt: Runtime, envelope: Envelope, contract: Contract, before: dict[str, Any],
                verdict: Classification, red: Redactor, token: int) -> FirstRead:
    """The verification read made in place, the lease renewed meanwhile (the fencing token still
    decides whether the verdict may be written)."""
    settings = rt.settings
    began = time.monotonic()
    with Heartbeat(rt.conn, envelope.action_id, token, settings.lease_ttl_seconds, settings.heartbeat_seconds,
                   touch=rt.touch):
        obs = first_read(rt, envelope, contract, envelope.model_dump(mode="json"), before, verdict.values or {}, red)
    return FirstRead(obs, time.monotonic() - began, finding_evidence(envelope, contract, obs, verdict.outcome))
