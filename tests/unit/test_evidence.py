"""Independent evidence, as pure logic: the contract's sources and policy as loaded, and the one
verdict the authoritative read and its sources make (worker/evidence.py's ``combine``)."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from ledger.states import RecoveryKind, VerificationFinding
from proofline.contracts import EvidencePolicy, Verification, load_contract
from proofline.settings import ROOT
from recovery.policy import Facts, decide
from worker.evidence import combine, source_verification

E, NR, AB, UN, PR = (VerificationFinding.expected, VerificationFinding.not_reached, VerificationFinding.absent,
                     VerificationFinding.unavailable, VerificationFinding.prohibited)
CONFLICT = VerificationFinding.evidence_conflict


def source(name: str, **kw) -> dict:
    return {"name": name, "tool": "find", "arguments": {"key": "envelope.idempotency_key"},
            "expected": ["after.found"], **kw}


def verification(sources: list[dict], **policy) -> Verification:
    return Verification.model_validate({"expected": ["after.found"], "sources": sources, "evidence": policy})


# --- the policy as declared ------------------------------------------------------------------------


def test_a_quorum_needs_a_size_within_the_reads():
    assert verification([source("audit")], rule="quorum", quorum=2).evidence.quorum == 2
    with pytest.raises(ValidationError, match="quorum between 1 and 2"):
        verification([source("audit")], rule="quorum", quorum=3)
    with pytest.raises(ValidationError, match="quorum between"):
        verification([source("audit")], rule="quorum")


def test_confirm_names_declared_sources_under_the_primary_rule_only():
    assert verification([source("audit")], rule="primary", confirm=["audit"]).evidence.confirm == ("audit",)
    with pytest.raises(ValidationError, match="names no source: monitor"):
        verification([source("audit")], rule="primary", confirm=["monitor"])
    with pytest.raises(ValidationError, match="primary rule only"):
        verification([source("audit")], rule="all", confirm=["audit"])


@pytest.mark.parametrize("names", [["audit", "audit"], ["primary"]])
def test_source_names_are_unique_and_not_primary(names):
    with pytest.raises(ValidationError, match="unique"):
        verification([source(n) for n in names])


def test_a_source_needs_an_expected_condition():
    with pytest.raises(ValidationError):
        verification([source("audit", expected=[])])


def test_source_cel_is_checked_at_load(tmp_path):
    raw = yaml.safe_load((ROOT / "contracts" / "ticket.create.yaml").read_text())
    raw["verification"]["sources"] = [source("audit", expected=["after.found &&"])]
    path = tmp_path / "ticket.create.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(Exception, match=r"verification\.sources\.0 \(audit\)\.expected\.0"):
        load_contract(path)


def test_read_tools_names_each_server_of_the_verification(tmp_path):
    raw = yaml.safe_load((ROOT / "contracts" / "ticket.create.yaml").read_text())
    raw["verification"]["sources"] = [source("audit", server="audit", tool="find_audit_entries"),
                                      source("again", tool="get_ticket")]
    path = tmp_path / "ticket.create.yaml"
    path.write_text(yaml.safe_dump(raw))
    contract = load_contract(path)
    assert contract.read_tools() == {"sor": {contract.verification_read.tool, "get_ticket"},
                                     "audit": {"find_audit_entries"}}


def test_a_reconciliation_search_is_one_more_named_read_on_its_server():
    v = Verification.model_validate({"expected": ["after.found"], "sources": [source("audit")],
                                     "reconcile": source("search", server="audit", tool="search_audit")})
    assert [s.name for s in v.all_sources] == ["audit", "search"]
    with pytest.raises(ValidationError, match="unique"):
        Verification.model_validate({"expected": ["after.found"], "sources": [source("audit")],
                                     "reconcile": source("audit")})


def test_a_source_polls_with_its_own_delay_and_at_least_once_past_it():
    v = verification([source("audit", consistency_delay_seconds=2.0, absent="!after.found")])
    own = source_verification(v, v.sources[0], seconds_left=0.0)
    assert own.consistency_delay_seconds == 2.0
    assert own.max_duration_seconds > 2.0 and own.absent == "!after.found" and own.expected == ("after.found",)
    inherited = source_verification(v, v.sources[0].model_copy(update={"consistency_delay_seconds": None}), 5.0)
    assert inherited.consistency_delay_seconds == v.consistency_delay_seconds
    assert inherited.max_duration_seconds == 5.0


# --- the verdict -----------------------------------------------------------------------------------


def test_without_sources_the_read_decides_alone():
    for finding in VerificationFinding:
        assert combine(EvidencePolicy(), finding, {}).finding == finding


@pytest.mark.parametrize(("sources", "want"), [
    ({"audit": E, "monitor": E}, E),
    ({"audit": E, "monitor": NR}, CONFLICT),
    ({"audit": AB, "monitor": E}, CONFLICT),
    ({"audit": E, "monitor": UN}, UN),   # silence is no confirmation, and no conflict either
])
def test_all_must_agree(sources, want):
    verdict = combine(EvidencePolicy(rule="all"), E, sources)
    assert verdict.finding == want
    assert verdict.summary["findings"] == {"primary": "expected", **{k: v.value for k, v in sources.items()}}


@pytest.mark.parametrize(("sources", "want"), [
    ({"audit": E, "monitor": NR}, E),    # 2 of 3: met, the dissent recorded
    ({"audit": NR, "monitor": UN}, CONFLICT),
    ({"audit": UN, "monitor": UN}, UN),
])
def test_a_quorum_of_two_of_three(sources, want):
    verdict = combine(EvidencePolicy(rule="quorum", quorum=2), E, sources)
    assert verdict.finding == want
    assert verdict.summary["met"] is (want == E)


def test_primary_with_confirm_ignores_sources_it_does_not_name():
    policy = EvidencePolicy(rule="primary", confirm=("audit",))
    assert combine(policy, E, {"audit": E, "monitor": NR}).finding == E
    assert combine(policy, E, {"audit": NR, "monitor": E}).finding == CONFLICT


def test_required_confidence_on_top_of_the_rule():
    policy = EvidencePolicy(rule="primary", confirm=("audit",), required_confidence=0.75)
    low = combine(policy, E, {"audit": E, "monitor": NR, "billing": UN})
    assert (low.finding, low.summary["confidence"], low.summary["met"]) == (CONFLICT, 0.5, False)
    high = combine(policy, E, {"audit": E, "monitor": E, "billing": UN})
    assert (high.finding, high.summary["confidence"]) == (E, 0.75)
    silent = combine(policy, E, {"audit": E, "monitor": UN, "billing": UN})
    assert silent.finding == UN


def test_a_source_that_saw_what_the_record_denies_is_a_conflict():
    assert combine(EvidencePolicy(), AB, {"audit": E}).finding == CONFLICT
    assert combine(EvidencePolicy(), NR, {"audit": E}).finding == CONFLICT
    assert combine(EvidencePolicy(), AB, {"audit": AB}).finding == AB
    # A prohibited state is a failure whatever else is seen; an unreadable record stays unproven.
    assert combine(EvidencePolicy(), PR, {"audit": E}).finding == PR
    assert combine(EvidencePolicy(), UN, {"audit": E}).finding == UN


# --- what recovery does with a conflict -------------------------------------------------------------


def facts(**kw) -> Facts:
    base = dict(outcome=None, finding=CONFLICT, attempts=1, max_attempts=3, seconds_left=60.0,
                retry_cost_seconds=1.0, is_compensation=False, irreversible=False)
    return Facts(**{**base, **kw})


def test_a_conflict_is_never_compensated_or_retried():
    policy = load_contract(ROOT / "contracts" / "refund.issue.yaml").recovery
    assert policy.compensation is not None
    decision = decide(facts(), policy)
    assert (decision.kind, decision.reason) == (RecoveryKind.manual_intervention, "evidence_conflict")
    contained = decide(facts(), policy.model_copy(update={"evidence_conflict": "contain"}))
    assert (contained.kind, contained.contain) == (RecoveryKind.containment, True)


def test_postcondition_regressions_count_re_checks_that_no_longer_hold_not_first_verifications():
    """A first verification that fails is a verification failure (``verifications{finding}``); a
    post-condition regression is a verified effect that a later re-check found gone or changed."""
    from proofline.telemetry.events import COUNTERS

    [regressions] = [c for c in COUNTERS if c.name == "postcondition_regressions"]
    first = {"prior_outcome": "completed_unverified", "finding": "evidence_conflict"}
    assert not regressions.matches("verification_finished", first)
    regressed = {"read_finding": "absent", "finding": "not_reached", "recheck": 2}
    assert regressions.matches("postcondition_regressed", regressed)
    assert regressions.labels[0].read("postcondition_regressed", regressed) == "absent"
    assert not regressions.matches("postcondition_held", {"finding": "expected"})
