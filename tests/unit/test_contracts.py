"""Action contracts: loading and hashing, CEL checked at load, result extraction, condition
evaluation, and the verification judge over the repository's real contracts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from mcp.types import CallToolResult, TextContent
from pydantic import ValidationError

from ledger.states import VerificationFinding
from proofline.conditions import ConditionError, evaluate, holds
from proofline.contracts import Extraction, contract_for, extract, load_contract, load_contracts
from proofline.errors import ExtractionFailed, UnknownActionType
from proofline.settings import ROOT
from recovery.verify import judge

CONTRACTS = ROOT / "contracts"
PATHS = sorted(CONTRACTS.glob("*.yaml"))
REFUND_TEXT = "refund R-3 issued for 1500 cents on acct-1"


def result(*texts: str, structured: dict[str, Any] | None = None) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=t) for t in texts], structured_content=structured)


# --- loading -----------------------------------------------------------------------------------------


def test_there_are_contracts():
    assert len(PATHS) >= 4


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_every_contract_loads_with_a_digest(path):
    contract = load_contract(path)
    assert contract.action_type == path.stem
    assert re.fullmatch(r"[0-9a-f]{64}", contract.digest)
    assert contract_for(CONTRACTS, contract.action_type).digest == contract.digest


def test_digests_are_distinct_and_directory_is_keyed_by_action_type():
    loaded = load_contracts(CONTRACTS)
    assert loaded.broken == {}
    assert set(loaded.contracts) == {p.stem for p in PATHS}
    assert len({c.digest for c in loaded.contracts.values()}) == len(loaded.contracts)


def test_unknown_action_type():
    with pytest.raises(UnknownActionType):
        contract_for(CONTRACTS, "ticket.delete")


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_digest_changes_when_content_changes(path, tmp_path):
    original = load_contract(path)
    raw = yaml.safe_load(path.read_text())
    raw["timeout_seconds"] = float(raw.get("timeout_seconds", 10)) + 1
    changed = tmp_path / path.name
    changed.write_text(yaml.safe_dump(raw))
    assert load_contract(changed).digest != original.digest

    raw["timeout_seconds"] -= 1
    raw["verification"]["expected"] = [*raw["verification"]["expected"], "true"]
    changed.write_text(yaml.safe_dump(raw))
    assert load_contract(changed).digest != original.digest


def test_digest_is_of_content_not_of_formatting(tmp_path):
    path = CONTRACTS / "ticket.create.yaml"
    copy = tmp_path / "ticket.create.yaml"
    copy.write_text("# a reworded comment\n" + yaml.safe_dump(yaml.safe_load(path.read_text()), sort_keys=True))
    assert copy.read_text() != path.read_text()
    assert load_contract(copy).digest == load_contract(path).digest


def _write_modified(tmp_path: Path, edit) -> Path:
    raw = yaml.safe_load((CONTRACTS / "service.restart.yaml").read_text())
    edit(raw)
    out = tmp_path / "service.restart.yaml"
    out.write_text(yaml.safe_dump(raw))
    return out


@pytest.mark.parametrize(
    "edit",
    [
        lambda raw: raw["verification"]["expected"].append("after.state == "),
        lambda raw: raw["verification"]["prohibited"].append("after.version !="),
        lambda raw: raw["verification"].update(absent="after.generation ==== 1"),
        lambda raw: raw["preconditions"].append({"name": "broken", "expr": "before.state == 'running"}),
        lambda raw: raw["precondition_read"]["arguments"].update(service="target.id +"),
        lambda raw: raw.update(operation_id="result.(operation_id"),
    ],
    ids=["expected", "prohibited", "absent", "precondition", "read-argument", "operation-id"],
)
def test_invalid_cel_fails_at_load(tmp_path, edit):
    with pytest.raises(ConditionError, match="cannot compile"):
        load_contract(_write_modified(tmp_path, edit))


def test_valid_edit_still_loads(tmp_path):
    """The same edit path with a valid expression loads: the failures above are the CEL, not the edit."""
    path = _write_modified(tmp_path, lambda raw: raw["verification"]["expected"].append("after.state == 'running'"))
    assert "after.state == 'running'" in load_contract(path).verification.expected


def test_unknown_field_in_contract_refused(tmp_path):
    with pytest.raises(ValidationError):
        load_contract(_write_modified(tmp_path, lambda raw: raw.update(retries_forever=True)))


def test_pattern_mode_needs_a_valid_pattern():
    with pytest.raises(ValidationError):
        Extraction(mode="pattern")
    with pytest.raises((ValidationError, re.error)):
        Extraction(mode="pattern", pattern="(?P<unclosed")


# --- extraction --------------------------------------------------------------------------------------


def test_extract_structured():
    data = {"operation_id": "op-1", "state": "restarting"}
    assert extract(result("ignored text", structured=data), Extraction(mode="structured")) == data


def test_extract_structured_falls_back_to_json_text():
    data = {"ticket": {"id": "T-1"}, "found": True}
    assert extract(result(json.dumps(data)), Extraction(mode="structured")) == data


def test_extract_structured_with_neither_fails():
    with pytest.raises(ExtractionFailed):
        extract(result("not json"), Extraction(mode="structured"))


def test_extract_json_text_ignores_structured_content():
    text = {"state": "running", "generation": 4}
    assert extract(result(json.dumps(text), structured={"other": 1}), Extraction(mode="json_text")) == text


def test_extract_json_text_joins_text_blocks():
    assert extract(result('{"a": ', '1}'), Extraction(mode="json_text")) == {"a": 1}


@pytest.mark.parametrize("text", ["plain text", "[1, 2]", '"a string"', ""])
def test_extract_json_text_refuses_non_objects(text):
    with pytest.raises(ExtractionFailed):
        extract(result(text), Extraction(mode="json_text"))


def test_extract_pattern_with_the_refund_contract():
    how = contract_for(CONTRACTS, "refund.issue").result
    assert how.mode == "pattern"
    values = extract(result(REFUND_TEXT), how)
    assert values == {"refund_id": "R-3", "amount_cents": 1500, "account": "acct-1"}
    assert isinstance(values["amount_cents"], int)


def test_extract_pattern_miss_fails():
    how = contract_for(CONTRACTS, "refund.issue").result
    with pytest.raises(ExtractionFailed):
        extract(result("refund R-3 pending"), how)


def test_extract_pattern_keeps_optional_groups_as_none():
    how = Extraction(mode="pattern", pattern=r"id=(?P<id>\w+)( v(?P<version>-?\d+))?")
    assert extract(result("id=abc"), how) == {"id": "abc", "version": None}
    assert extract(result("id=abc v-2"), how) == {"id": "abc", "version": -2}


# --- conditions --------------------------------------------------------------------------------------


def test_holds_true_and_false():
    variables = {"after": {"state": "running", "instances": 3}}
    assert holds("after.state == 'running' && after.instances == 3", variables) is True
    assert holds("after.instances > 3", variables) is False


def test_holds_raises_on_missing_field():
    with pytest.raises(ConditionError):
        holds("after.state == 'running'", {"after": {"version": "1.0"}})


def test_holds_raises_on_missing_variable():
    with pytest.raises(ConditionError):
        holds("before.found", {"after": {}})


@pytest.mark.parametrize("expr", ["after.instances", "after.state", "after.instances + 1", "after"])
def test_holds_raises_on_non_boolean(expr):
    variables = {"after": {"state": "running", "instances": 3}}
    assert evaluate(expr, variables) is not None
    with pytest.raises(ConditionError, match="not a boolean"):
        holds(expr, variables)


# --- verification judge ------------------------------------------------------------------------------


RESTART = contract_for(CONTRACTS, "service.restart").verification
CREATE = contract_for(CONTRACTS, "ticket.create").verification


def restart_vars(**after: Any) -> dict[str, Any]:
    before = {"service": "api", "tenant": "acme", "state": "running", "version": "2.4.1", "generation": 4,
              "instances": 3, "healthy_instances": 3, "active_operation": None}
    return {"envelope": {"tenant": "acme"}, "args": {"service": "api"},
            "target": {"type": "service", "id": "api", "expected_version": 4},
            "before": before, "after": {**before, **after}}


def create_vars(after: dict[str, Any]) -> dict[str, Any]:
    args = {"tenant": "acme", "title": "Disk full", "owner": "ops"}
    return {"envelope": {"tenant": "acme", "arguments": args}, "args": args,
            "target": {"type": "ticket_queue", "id": "support"}, "before": {"found": False}, "after": after}


TICKET = {"id": "T-7", "title": "Disk full", "owner": "ops", "tenant": "acme", "status": "open", "version": 1}


@pytest.mark.parametrize("settled", [False, True])
def test_restart_expected(settled):
    assert judge(RESTART, restart_vars(generation=6), settled=settled) is VerificationFinding.expected


@pytest.mark.parametrize(
    "after",
    [{"generation": 6, "version": "2.5.0"}, {"generation": 8}, {"generation": 7, "state": "restarting"}],
    ids=["version-changed", "restarted-twice", "third-restart-in-progress"],
)
def test_restart_prohibited(after):
    assert judge(RESTART, restart_vars(**after), settled=True) is VerificationFinding.prohibited


def test_prohibited_beats_tolerated():
    variables = restart_vars(generation=7, state="restarting")
    assert holds(RESTART.tolerated[0], variables)
    assert judge(RESTART, variables, settled=False) is VerificationFinding.prohibited


def test_prohibited_beats_expected():
    variables = restart_vars(generation=6)
    stricter = RESTART.model_copy(update={"prohibited": (*RESTART.prohibited, "after.instances < 5")})
    assert all(holds(expr, variables) for expr in stricter.expected)
    assert judge(RESTART, variables, settled=True) is VerificationFinding.expected
    assert judge(stricter, variables, settled=True) is VerificationFinding.prohibited


@pytest.mark.parametrize("settled", [False, True])
def test_restart_in_progress_is_tolerated(settled):
    variables = restart_vars(generation=5, state="restarting", healthy_instances=1)
    assert judge(RESTART, variables, settled=settled) is VerificationFinding.tolerated


def test_restart_absent_only_when_settled():
    variables = restart_vars()  # nothing changed: generation 4, running
    assert judge(RESTART, variables, settled=False) is VerificationFinding.not_reached
    assert judge(RESTART, variables, settled=True) is VerificationFinding.absent


def test_restart_half_done_and_running_is_not_reached():
    variables = restart_vars(generation=5)
    assert judge(RESTART, variables, settled=True) is VerificationFinding.not_reached


def test_create_expected():
    assert judge(CREATE, create_vars({"found": True, "ticket": TICKET}), settled=True) is VerificationFinding.expected


def test_create_wrong_tenant_is_prohibited():
    after = {"found": True, "ticket": {**TICKET, "tenant": "globex"}}
    assert judge(CREATE, create_vars(after), settled=True) is VerificationFinding.prohibited


def test_create_wrong_title_is_not_reached():
    after = {"found": True, "ticket": {**TICKET, "title": "Disk empty"}}
    assert judge(CREATE, create_vars(after), settled=True) is VerificationFinding.not_reached


def test_create_absent_only_when_settled():
    variables = create_vars({"found": False})
    assert judge(CREATE, variables, settled=False) is VerificationFinding.not_reached
    assert judge(CREATE, variables, settled=True) is VerificationFinding.absent


def test_unevaluable_read_is_never_success():
    """found but no ticket object: expected and prohibited both fail to evaluate."""
    variables = create_vars({"found": True})
    with pytest.raises(ConditionError):
        holds(CREATE.expected[1], variables)
    assert judge(CREATE, variables, settled=True) is VerificationFinding.not_reached


def test_a_result_nested_too_deeply_is_refused_by_extraction_without_recursing() -> None:
    from mcp.types import CallToolResult, TextContent

    from proofline.contracts import MAX_NESTING, Extraction, extract, nesting_within

    deep_text = CallToolResult(content=[TextContent(type="text", text='{"a":' * 200_000 + "1" + "}" * 200_000)])
    with pytest.raises(ExtractionFailed, match="nests deeper"):
        extract(deep_text, Extraction(mode="json_text"))
    nested: dict = {"leaf": 1}
    for _ in range(MAX_NESTING + 5):
        nested = {"a": [nested]}
    with pytest.raises(ExtractionFailed, match=f"deeper than {MAX_NESTING}"):
        extract(CallToolResult(content=[], structured_content=nested), Extraction())
    assert nesting_within({"a": [{"b": 1}]}, limit=3) and not nesting_within({"a": [{"b": [1]}]}, limit=3)


def test_contract_retention_classes_are_the_ledger_classes():
    from typing import get_args

    from ledger.states import RetentionClass
    from proofline.contracts import Contract

    allowed = get_args(Contract.model_fields["retention_class"].annotation)
    assert set(allowed) == {c.value for c in RetentionClass}
