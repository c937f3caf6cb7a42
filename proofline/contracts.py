"""Action contracts: one versioned YAML file per action type, hashed as loaded.

A contract says which tool performs the action, how to read the target through an
authoritative read path, what must hold before the call, which outcomes are expected, tolerated
or prohibited afterwards, how to read values out of the tool's result, and how tool errors map to
outcome classes. Conditions are CEL (see ``proofline/conditions.py``).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from proofline.canonical import sha256_hex
from proofline.conditions import CompiledConditions, compile_expression, compiled_for
from proofline.errors import (
    ConditionError,
    ContractInvalid,
    ExtractionFailed,
    ProoflineError,
    UnknownActionType,
)
from proofline.recheck import Recheck
from proofline.server_requests import ServerRequestPolicy

SENSITIVE_PATH = re.compile(r"(args|result|before|after)(\.[A-Za-z0-9_\-]+)+")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Extraction(_Model):
    """How to read a JSON object out of a tool result.

    ``structured``: the result's structured content. ``json_text``: the first text block parsed as
    JSON. ``pattern``: a regular expression with named groups matched against the text.
    """

    mode: Literal["structured", "json_text", "pattern"] = "structured"
    pattern: str | None = None

    @model_validator(mode="after")
    def _pattern_needs_regex(self) -> Extraction:
        if self.mode == "pattern":
            if not self.pattern:
                raise ValueError("mode 'pattern' needs a pattern")
            re.compile(self.pattern)
        return self


class Condition(_Model):
    name: str
    expr: str
    #: Reason code recorded when this precondition fails.
    reason: str = "precondition_failed"


class ReadPath(_Model):
    """An authoritative read: a read tool and how to build its arguments (CEL per argument)."""

    tool: str
    arguments: dict[str, str]
    extract: Extraction = Extraction()


class Prepare(ReadPath):
    """How to ask the system of record for a plan (a preview of the change) before the write: a
    read-only tool called through the read identity, its arguments, and where the plan says what it is.

    ``plan_id`` and ``target_version`` are CEL over ``plan`` (the extracted result), ``envelope``,
    ``args`` and ``target``."""

    #: The downstream's own id for this plan, when it gives one.
    plan_id: str | None = None
    #: The version of the target the plan was computed against; compared again before the call.
    target_version: str | None = None


class OperationRecordRead(ReadPath):
    """Where the downstream keeps an asynchronous operation's own status record (a job status API,
    an MCP Task): read once when verification starts. That record is evidence, never the verdict;
    the authoritative read decides."""

    #: CEL over ``operation`` (this read's result): true when the record is no longer served
    #: (expired or deleted by the downstream).
    gone: str


class EvidenceSource(ReadPath):
    """One more read of the effect, on any configured server (the contract's own by default), made
    through that server's read identity and judged by its own conditions over its own ``after``."""

    #: Names this source in the policy (``confirm``) and in the ledger's evidence records.
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    #: A server of the servers file; unset: the contract's server.
    server: str | None = None
    expected: tuple[str, ...] = Field(min_length=1)
    prohibited: tuple[str, ...] = ()
    #: True when this source shows the effect did not happen (decisive once its delay has passed).
    absent: str | None = None
    #: How long this source may lag behind the write (an audit log fed asynchronously); unset: the
    #: verification's ``consistency_delay_seconds``.
    consistency_delay_seconds: float | None = Field(default=None, ge=0)


class EvidencePolicy(_Model):
    """How the authoritative read and the extra sources make one verdict.

    ``all``: every source confirms. ``quorum``: at least ``quorum`` of the 1 + len(sources) reads
    confirm. ``primary``: the authoritative read and every source named in ``confirm``.
    ``required_confidence``: the fraction of all reads that must confirm, on top of the rule."""

    rule: Literal["all", "quorum", "primary"] = "all"
    quorum: int | None = Field(default=None, ge=1)
    confirm: tuple[str, ...] = ()
    required_confidence: float = Field(default=0.0, ge=0, le=1)


class Verification(_Model):
    max_duration_seconds: float = Field(default=30.0, gt=0, le=3600)
    poll_interval_seconds: float = Field(default=0.5, gt=0, le=600)
    #: Reads before this delay has passed that do not yet show the effect are not failures.
    consistency_delay_seconds: float = Field(default=0.0, ge=0)
    read: ReadPath | None = None  # defaults to the precondition read path
    #: The downstream operation's status record, read for evidence before the authoritative read.
    operation_record: OperationRecordRead | None = None
    expected: tuple[str, ...]
    tolerated: tuple[str, ...] = ()
    prohibited: tuple[str, ...] = ()
    #: True when ``after`` shows the effect did not happen at all (used to settle unknown outcomes).
    absent: str | None = None
    #: Independent evidence: more reads of the effect, on this or other servers (``docs/concepts/
    #: independent-evidence.md``); ``evidence`` says how they and the authoritative read agree.
    sources: tuple[EvidenceSource, ...] = ()
    evidence: EvidencePolicy = EvidencePolicy()
    #: How to settle an unknown outcome while this read path is down: a search of another system
    #: (an audit log, by idempotency key or operation id) whose ``expected`` conditions say the
    #: effect happened. It can only ever say "it happened"; its silence proves nothing.
    reconcile: EvidenceSource | None = None
    #: Re-read the verified effect later (``proofline/recheck.py``): offsets after the verdict
    #: within a horizon; a re-check that no longer holds is ``postcondition_regressed``.
    recheck: Recheck | None = None

    @property
    def all_sources(self) -> tuple[EvidenceSource, ...]:
        """The evidence sources and the reconciliation search: every extra read the verification may make."""
        return (*self.sources, *([self.reconcile] if self.reconcile else []))

    @model_validator(mode="after")
    def _policy_fits_sources(self) -> Verification:
        names = [s.name for s in self.all_sources]
        if len(set(names)) != len(names) or "primary" in names:
            raise ValueError("evidence source names must be unique and not 'primary'")
        policy, reads = self.evidence, 1 + len(self.sources)
        if policy.rule == "quorum" and (policy.quorum is None or policy.quorum > reads):
            raise ValueError(f"a quorum rule needs quorum between 1 and {reads} (the read and its sources)")
        if policy.rule != "quorum" and policy.quorum is not None:
            raise ValueError("quorum applies to the quorum rule only")
        unknown = sorted(set(policy.confirm) - set(names))
        if unknown:
            raise ValueError(f"evidence.confirm names no source: {', '.join(unknown)}")
        if policy.confirm and policy.rule != "primary":
            raise ValueError("confirm applies to the primary rule only")
        return self


OutcomeName = Literal["failed_before_side_effect", "failed_after_side_effect", "unknown_outcome"]


class ToolErrors(_Model):
    """How a tool error maps to an outcome class."""

    #: Name of the machine-readable error class field in the error's structured content / JSON text.
    class_field: str = "error_class"
    #: Error classes the server may send, mapped to outcome classes.
    classes: dict[str, OutcomeName] = Field(
        default_factory=lambda: {
            "failed_before_side_effect": "failed_before_side_effect",
            "failed_after_side_effect": "failed_after_side_effect",
        }
    )
    #: An error with no recognised class: the side effect is uncertain unless the contract knows better.
    default: OutcomeName = "unknown_outcome"


class DerivedAction(_Model):
    """How to build a recovery action (compensation, rollback, forward fix) from recorded facts.

    Every value is a CEL expression over ``envelope``, ``args``, ``target``, ``before`` (the
    precondition snapshot), ``after`` (the last verification read) and ``result``: the recovery
    data recorded at execution time, never anything reconstructed from a transcript.
    """

    action_type: str
    target: dict[str, str]
    arguments: dict[str, str]


class Recovery(_Model):
    """The contract's recovery policy (the seed's ``recovery:`` block)."""

    transient_failure: Literal["retry_same_idempotency_key", "manual"] = "retry_same_idempotency_key"
    unknown_outcome: Literal["reconcile"] = "reconcile"
    partial_completion: Literal["contain_then_evaluate", "compensate", "manual"] = "contain_then_evaluate"
    verification_failure: Literal["manual_or_compensate", "compensate", "native_rollback", "forward_recovery",
                                  "manual", "contain"] = "manual_or_compensate"
    #: Independent sources disagree: ``escalate`` hands the action to an operator with every
    #: reading; ``contain`` also sets a kill switch on the tool for the tenant. Never compensated
    #: automatically: which reading is true is not known.
    evidence_conflict: Literal["escalate", "contain"] = "escalate"
    compensation: DerivedAction | None = None
    rollback: DerivedAction | None = None
    forward: DerivedAction | None = None


class EvidenceCapture(_Model):
    """What the protected evidence store keeps of this action type, unredacted and sealed to the
    auditor (docs/security/evidence-store.md). Off unless a flag is set."""

    #: The tool's arguments exactly as sent.
    arguments: bool = False
    #: The tool result's values (what ``result`` extracts) as received.
    result: bool = False
    #: The reads of the target: the precondition read and the verification reads.
    reads: bool = False
    #: The retention class each capture is stored under (``ledger.states.RetentionClass``; how long
    #: each class lasts is a setting, and ``proofline ledger prune`` removes captures past it).
    retention: Literal["short", "standard", "audit", "legal_hold"] = "audit"

    @property
    def enabled(self) -> bool:
        return self.arguments or self.result or self.reads


class McpTask(_Model):
    """Call the tool as an MCP Task (task-augmented ``tools/call``, protocol 2025-11-25; an
    extension from 2026-07-28), when the server advertises Tasks: ``worker/mcp_tasks.py``."""

    #: The time to live requested for the task (the server may grant less): how long its status
    #: and result stay retrievable. Past it the outcome is settled by verification.
    ttl_seconds: float = Field(default=60.0, gt=0, le=86_400)
    #: Bounds on the wait between two ``tasks/get``: the server's ``pollInterval`` is honoured inside them.
    min_poll_seconds: float = Field(default=0.05, gt=0)
    max_poll_seconds: float = Field(default=5.0, gt=0)


class Contract(_Model):
    action_type: str
    version: int = Field(ge=1)
    server: str
    tool: str
    operation: str
    target_type: str
    #: The call returns before the work is done (e.g. an operation id); verification waits for it.
    asynchronous: bool = False
    #: Run the call as an MCP Task and poll it (``mcp_task: {ttl_seconds: 60}``); unset: a plain call.
    mcp_task: McpTask | None = None
    #: CEL mapping from the envelope to the tool's arguments is the envelope's own arguments.
    result: Extraction = Extraction()
    #: CEL over ``result`` giving the downstream operation id, when the tool returns one.
    operation_id: str | None = None
    precondition_read: ReadPath
    #: A read-only prepare tool giving the plan an approver reviews (see ``proofline/plan.py``);
    #: without one the plan is the precondition snapshot plus the arguments.
    prepare: Prepare | None = None
    preconditions: tuple[Condition, ...] = ()
    verification: Verification
    tool_errors: ToolErrors = ToolErrors()
    idempotency_scope: Literal["tenant", "global"] = "tenant"
    #: Whether the downstream tool honours the idempotency key in ``_meta`` (informational; never trusted).
    downstream_honours_key: bool = False
    timeout_seconds: float = Field(default=10.0, gt=0)
    recovery: Recovery = Recovery()
    point_of_no_return: bool = False
    #: Fields whose values never reach storage, logs or Sentry: ``args.<name>`` (an argument),
    #: ``result.<name>``, ``before.<name>``, ``after.<name>`` (nested: ``args.auth.pin``). The last
    #: part is redacted by name wherever it appears in this action's records, and an argument's
    #: value wherever it reappears (ledger/redact.py).
    sensitive_fields: tuple[str, ...] = ()
    #: Raw arguments, results and reads captured encrypted for the auditor (redaction still applies
    #: everywhere else): ``{arguments: true, result: true, reads: true, retention: audit}``.
    evidence_capture: EvidenceCapture = EvidenceCapture()
    #: CEL over ``args`` (and ``envelope``, ``target``) giving the amount of money this action moves,
    #: in cents; checked against the envelope's ``authority_budget.max_amount_cents``, per action and
    #: summed over its run. Every money-moving contract declares it.
    amount_cents: str | None = None
    #: Largest tool result (bytes) this contract reads; the servers file and the settings bound it too.
    max_result_bytes: int | None = Field(default=None, gt=0)
    #: Narrows the servers' answers to their requests mid-call (elicitation, sampling, roots) for
    #: this action type: it may refuse what a server's policy answers, never answer what it refuses.
    server_requests: ServerRequestPolicy | None = None
    #: How long the settled action and its evidence are kept (ledger.states.RetentionClass; the
    #: durations are settings): ``short``, ``standard``, ``audit`` or ``legal_hold`` (never pruned).
    retention_class: Literal["short", "standard", "audit", "legal_hold"] = "standard"
    #: Filled in by the loader: sha256 of the contract's canonical JSON.
    digest: str = ""

    @model_validator(mode="after")
    def _sensitive_paths(self) -> Contract:
        for path in self.sensitive_fields:
            if not SENSITIVE_PATH.fullmatch(path):
                raise ValueError(f"sensitive field {path!r} is not args|result|before|after.<name>[.<name>…]")
        return self

    @model_validator(mode="after")
    def _prepare_is_not_the_write(self) -> Contract:
        # A plan is read, never written: the write tool cannot be its own preview.
        if self.prepare is not None and self.prepare.tool == self.tool:
            raise ValueError(f"prepare.tool {self.prepare.tool!r} is the write tool; a prepare tool only reads")
        return self

    @model_validator(mode="after")
    def _compile_conditions(self) -> Contract:
        for where, expr in self._expressions():
            try:
                compile_expression(expr)
            except ConditionError as exc:
                # Name the field: a contract has dozens of expressions.
                raise type(exc)(f"{where}: {exc.detail}", **exc.context) from None
        return self

    def tools_used(self) -> tuple[tuple[str, str], ...]:
        """Every tool of the contract's server the worker calls, with the field that names it: the
        write tool, the precondition read, the verification reads and the prepare tool. (A recovery action is a
        contract of its own, with its own tools.)"""
        v = self.verification
        found = [("tool", self.tool), ("precondition_read.tool", self.precondition_read.tool)]
        found += [("verification.read.tool", v.read.tool)] if v.read else []
        found += [("verification.operation_record.tool", v.operation_record.tool)] if v.operation_record else []
        found += [("prepare.tool", self.prepare.tool)] if self.prepare is not None else []
        return tuple(found)

    def recovery_action_types(self) -> tuple[tuple[str, str], ...]:
        """The action types this contract's recovery derives, with the field that names each."""
        kinds = ("compensation", "rollback", "forward")
        return tuple((f"recovery.{k}.action_type", getattr(self.recovery, k).action_type) for k in kinds
                     if getattr(self.recovery, k) is not None)

    def _expressions(self) -> list[tuple[str, str]]:
        """Every CEL expression of the contract, with the field it sits in."""
        v = self.verification
        found = [(f"preconditions.{i}.expr ({c.name})", c.expr) for i, c in enumerate(self.preconditions)]
        for name in ("expected", "tolerated", "prohibited"):
            found += [(f"verification.{name}.{i}", e) for i, e in enumerate(getattr(v, name))]
        found += [("verification.absent", v.absent)] if v.absent else []
        for i, src in enumerate(v.all_sources):
            where = f"verification.sources.{i} ({src.name})" if i < len(v.sources) else "verification.reconcile"
            found += [(f"{where}.arguments.{k}", e) for k, e in src.arguments.items()]
            found += [(f"{where}.{name}.{j}", e) for name in ("expected", "prohibited")
                      for j, e in enumerate(getattr(src, name))]
            found += [(f"{where}.absent", src.absent)] if src.absent else []
        for field, read in (("precondition_read", self.precondition_read), ("verification.read", v.read),
                            ("verification.operation_record", v.operation_record), ("prepare", self.prepare)):
            found += [(f"{field}.arguments.{k}", e) for k, e in (read.arguments.items() if read else ())]
        found += [("verification.operation_record.gone", v.operation_record.gone)] if v.operation_record else []
        found += [(f"prepare.{name}", e) for name, e in (("plan_id", self.prepare.plan_id),
                                                         ("target_version", self.prepare.target_version)) if e
                  ] if self.prepare else []
        found += [(name, e) for name, e in (("operation_id", self.operation_id), ("amount_cents", self.amount_cents))
                  if e]
        for kind in ("compensation", "rollback", "forward"):
            derived = getattr(self.recovery, kind)
            for part in ("target", "arguments"):
                found += [(f"recovery.{kind}.{part}.{k}", e) for k, e in (getattr(derived, part).items()
                                                                          if derived else ())]
        return found

    def compiled(self) -> CompiledConditions:
        """Every expression of this contract compiled, once per process and contract digest."""
        digest = self.digest or sha256_hex(self.model_dump(mode="json"))
        return compiled_for(digest, lambda: [expr for _, expr in self._expressions()])

    @property
    def verification_read(self) -> ReadPath:
        return self.verification.read or self.precondition_read

    def source_server(self, source: EvidenceSource) -> str:
        """The server an evidence source reads from."""
        return source.server or self.server

    def read_tools(self) -> dict[str, set[str]]:
        """Every read tool the verification calls, by server: the authoritative read and each source."""
        found: dict[str, set[str]] = {self.server: {self.verification_read.tool}}
        for src in self.verification.all_sources:
            found.setdefault(self.source_server(src), set()).add(src.tool)
        return found


def load_contract(path: Path) -> Contract:
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a contract is a mapping")
    digest = sha256_hex(raw)
    return Contract.model_validate({**raw, "digest": digest})


@dataclass(frozen=True)
class ContractSet:
    """Every contract of a directory, loaded file by file: one broken file refuses its own action
    type (named by the file, ``<action_type>.yaml``) and nothing else."""

    contracts: dict[str, Contract]
    #: action type -> (file, reason) for every file that could not be loaded.
    broken: dict[str, tuple[str, str]]


def _reason(exc: BaseException) -> str:
    """Why a file is refused, on one line, naming the field (or the YAML line) at fault."""
    if isinstance(exc, ValidationError):
        first = exc.errors(include_url=False)[:3]
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'contract'}: {e['msg']}" for e in first)
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
    text = str(exc) if isinstance(exc, ProoflineError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:500]


def scan_contracts(directory: Path) -> ContractSet:
    """Load every ``*.yaml`` of ``directory`` now (uncached: what ``proofline contracts check`` runs)."""
    contracts: dict[str, Contract] = {}
    broken: dict[str, tuple[str, str]] = {}
    for path in sorted(Path(directory).glob("*.yaml")):
        try:
            contract = load_contract(path)
        except Exception as exc:  # noqa: BLE001 - whatever breaks one file is that file's refusal
            broken[path.stem] = (path.name, _reason(exc))
            continue
        if contract.action_type in contracts or contract.action_type in broken:
            broken[contract.action_type] = (path.name, f"a second contract for {contract.action_type!r}")
            contracts.pop(contract.action_type, None)
            continue
        contracts[contract.action_type] = contract
    return ContractSet(contracts, broken)


#: How often a process looks at a contracts folder again for added, removed or changed files.
RELOAD_SECONDS = 1.0
_loaded: dict[str, tuple[float, tuple[tuple[str, int, int], ...] | None, ContractSet]] = {}


def _signature(directory: Path) -> tuple[tuple[str, int, int], ...] | None:
    try:
        return tuple(sorted((p.name, st.st_mtime_ns, st.st_size) for p in directory.glob("*.yaml")
                            for st in (p.stat(),)))
    except OSError:
        return None


def load_contracts(directory: Path) -> ContractSet:
    """The contracts of ``directory``: loaded once, and again when a file is added, removed or
    changed (the folder is looked at no more than once every :data:`RELOAD_SECONDS`), so a running
    worker takes a new or edited contract without a restart. What each action ran under is in its
    ``validated`` event (the contract's version and digest)."""
    key, now = str(directory), time.monotonic()
    hit = _loaded.get(key)
    if hit is not None and now - hit[0] < RELOAD_SECONDS:
        return hit[2]
    signature = _signature(Path(directory))
    loaded = hit[2] if hit is not None and hit[1] == signature else scan_contracts(directory)
    _loaded[key] = (now, signature, loaded)
    return loaded


def contract_for(directory: Path, action_type: str) -> Contract:
    loaded = load_contracts(Path(directory))
    if action_type in loaded.broken:
        name, reason = loaded.broken[action_type]
        raise ContractInvalid(f"contract file {name} for {action_type!r} is refused: {reason}", file=name)
    try:
        return loaded.contracts[action_type]
    except KeyError:
        raise UnknownActionType(f"no contract for action type {action_type!r}") from None


#: How deeply a value read out of a tool result may nest. Deeper than this, every later step (CEL,
#: redaction, canonical JSON, the ledger's JSONB) would fail or recurse without bound: such a result
#: is unreadable here, at the boundary, where the call's evidence is still written.
MAX_NESTING = 64


def nesting_within(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether ``value`` nests at most ``limit`` levels of objects and arrays (iterative: a hostile
    value cannot exhaust the stack here)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def extract(result: Any, how: Extraction) -> dict[str, Any]:
    """Read a JSON object out of an MCP ``CallToolResult`` as the contract declares."""
    data = _extract(result, how)
    if not nesting_within(data):
        raise ExtractionFailed(f"the result nests deeper than {MAX_NESTING} levels")
    return data


def _extract(result: Any, how: Extraction) -> dict[str, Any]:
    if how.mode == "structured":
        data = getattr(result, "structured_content", None)
        if isinstance(data, dict):
            return data
        # Servers on older SDKs often send the same JSON as text only: accept it, it is the same value.
        return _extract(result, Extraction(mode="json_text"))
    text = "".join(getattr(block, "text", "") for block in getattr(result, "content", []) or [])
    if how.mode == "json_text":
        try:
            data = json.loads(text)
        except RecursionError:
            raise ExtractionFailed(f"result text nests deeper than the JSON parser goes: {text[:100]!r}") from None
        except ValueError as exc:
            raise ExtractionFailed(f"result text is not JSON: {text[:200]!r}") from exc
        if not isinstance(data, dict):
            raise ExtractionFailed("result JSON is not an object")
        return data
    match = re.search(how.pattern or "", text)
    if match is None:
        raise ExtractionFailed(f"pattern did not match result text {text[:200]!r}")
    return {k: _number_or_text(v) for k, v in match.groupdict().items()}


def _number_or_text(value: str | None) -> Any:
    if value is not None and re.fullmatch(r"-?\d+", value):
        return int(value)
    return value
