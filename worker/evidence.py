"""Independent evidence: the contract's extra reads of an effect, and the one verdict they make
with the authoritative read.

Each source is read on its own server through that server's read identity and judged by its own
conditions; the contract's evidence policy (``all``, ``quorum``, ``primary`` with ``confirm``, and a
required confidence) decides whether the reads together prove the effect. Sources that answered
and disagree make ``evidence_conflict``, never ``expected``; sources that could not be read are a
lack of evidence (``unavailable``), never a confirmation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ledger.states import VerificationFinding
from proofline.contracts import Contract, EvidencePolicy, EvidenceSource, Verification
from proofline.errors import ProoflineError
from worker.runtime import Runtime
from worker.verification import Observation, poll

PRIMARY = "primary"
#: A read that answered and shows the effect is not there (or not as approved).
DENIALS = frozenset({VerificationFinding.prohibited, VerificationFinding.not_reached, VerificationFinding.absent})
#: Primary findings that make the sources worth reading: the effect claimed, or claimed absent.
CONSULTED = frozenset({VerificationFinding.expected, VerificationFinding.absent, VerificationFinding.not_reached})


@dataclass(frozen=True)
class Reading:
    """One source's answer as the ledger keeps it."""

    source: str
    server: str
    tool: str
    obs: Observation
    seconds: float

    def record(self) -> dict[str, Any]:
        o = self.obs
        return {"source": self.source, "server": self.server, "identity": "read", "tool": self.tool,
                "finding": o.finding.value, "reads": o.reads, "failed_reads": o.failed_reads,
                "last_error": o.last_error, "latency_ms": round(self.seconds * 1000), "after": o.after,
                "timeline": o.kept, **o.requests(), **({"condition_errors": o.condition_errors} if o.condition_errors else {})}


@dataclass(frozen=True)
class Verdict:
    finding: VerificationFinding
    #: What the ledger records of the decision (rule, counts, confidence, each source's finding).
    summary: dict[str, Any]


def combine(policy: EvidencePolicy, primary: VerificationFinding,
            sources: dict[str, VerificationFinding]) -> Verdict:
    """The verdict of the authoritative read (``primary``) and its sources, by ``policy``.

    Pure: the same findings always give the same verdict."""
    findings = {PRIMARY: primary, **sources}
    confirming = sorted(name for name, f in findings.items() if f == VerificationFinding.expected)
    denying = sorted(name for name, f in findings.items() if f in DENIALS)
    confidence = len(confirming) / len(findings)
    summary: dict[str, Any] = {"rule": policy.rule, "findings": {k: v.value for k, v in findings.items()},
                               "confirming": confirming, "denying": denying, "confidence": round(confidence, 4),
                               "required_confidence": policy.required_confidence}
    if not sources:
        return Verdict(primary, summary)
    if primary != VerificationFinding.expected:
        # The system of record says the effect is not there; a source that saw it means the two
        # systems disagree about money that may have moved: a retry or an undo could be wrong.
        if primary in CONSULTED and VerificationFinding.expected in sources.values():
            return Verdict(VerificationFinding.evidence_conflict, {**summary, "met": False})
        return Verdict(primary, summary)
    if policy.rule == "all":
        needed = list(findings)
    elif policy.rule == "primary":
        needed = [PRIMARY, *policy.confirm]
    else:
        needed = []
    met = all(findings[name] == VerificationFinding.expected for name in needed)
    if policy.rule == "quorum":
        met = len(confirming) >= (policy.quorum or len(findings))
        summary["quorum"] = policy.quorum
    met = met and confidence >= policy.required_confidence
    summary["met"] = met
    if met:
        return Verdict(VerificationFinding.expected, summary)
    # Not proven. A source that answered and disagrees is a conflict; silence is lack of evidence.
    return Verdict(VerificationFinding.evidence_conflict if denying else VerificationFinding.unavailable, summary)


def source_verification(v: Verification, source: EvidenceSource, seconds_left: float) -> Verification:
    """The polling bounds and conditions of one source: its own conditions and delay, the
    verification's poll interval, and what is left of its time (at least the delay and one poll)."""
    delay = v.consistency_delay_seconds if source.consistency_delay_seconds is None \
        else source.consistency_delay_seconds
    return Verification(max_duration_seconds=max(seconds_left, delay + v.poll_interval_seconds, 0.001),
                        poll_interval_seconds=v.poll_interval_seconds, consistency_delay_seconds=delay,
                        expected=source.expected, prohibited=source.prohibited, absent=source.absent)


def read_sources(rt: Runtime, contract: Contract, sources: tuple[EvidenceSource, ...], base: dict[str, Any],
                 seconds_left: float) -> list[Reading]:
    """Read each of ``sources`` until it gives a decisive finding or reaches its bound, one after
    another, each through its own server's read identity."""
    v = contract.verification
    readings = []
    deadline = time.monotonic() + seconds_left
    for source in sources:
        name = contract.source_server(source)
        began = time.monotonic()
        try:
            server = rt.server(name)
        except ProoflineError as exc:
            # A server the servers file does not name cannot confirm anything: recorded, unavailable.
            obs = Observation(VerificationFinding.unavailable, failed_reads=1, last_error=str(exc)[:300])
        else:
            obs = poll(rt, server, contract, source, source_verification(v, source, deadline - began), base)
        readings.append(Reading(source.name, name, source.tool, obs, time.monotonic() - began))
    return readings


def reconcile_unknown(rt: Runtime, contract: Contract, base: dict[str, Any], seconds_left: float) -> Reading | None:
    """For an unknown outcome whose authoritative read path is down: the contract's reconciliation
    search (``verification.reconcile``), if it has one. Its ``expected`` finding means the effect
    happened; any other finding leaves the outcome unknown."""
    search = contract.verification.reconcile
    return None if search is None else read_sources(rt, contract, (search,), base, seconds_left)[0]


def decide(rt: Runtime, contract: Contract, primary: Observation, primary_server: str, primary_seconds: float,
           base: dict[str, Any], seconds_left: float) -> tuple[Verdict, list[dict[str, Any]]]:
    """Read the sources when the primary finding calls for them and combine: the verdict and one
    evidence record per read (the authoritative read first)."""
    first = Reading(PRIMARY, primary_server, contract.verification_read.tool, primary, primary_seconds)
    if not contract.verification.sources or primary.finding not in CONSULTED:
        return combine(contract.verification.evidence, primary.finding, {}), [first.record()]
    readings = read_sources(rt, contract, contract.verification.sources, base, seconds_left)
    verdict = combine(contract.verification.evidence, primary.finding, {r.source: r.obs.finding for r in readings})
    return verdict, [first.record(), *(r.record() for r in readings)]
