"""Plans as pure logic: the hash, the comparison before the call, the diff, the contract's
``prepare:`` block and how pins see a prepare tool. The same calls against a real system of
record are in tests/integration/test_prepare_plans.py."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import yaml

from proofline.canonical import sha256_hex
from proofline.contracts import Contract, contract_for, load_contract
from proofline.errors import ConditionError, PlanChanged, PrepareFailed, RevalidationFailed, TargetReadFailed
from proofline.pins import pin_server, problems
from proofline.plan import Plan, PlanSource, check_plan, new_plan, plan_diff, plan_hash
from proofline.settings import ROOT

CONTRACTS = ROOT / "contracts"
CONTENT = {"changes": [{"field": "status", "before": "open", "after": "closed"}], "target_version": 3}


def _plan(**kw) -> Plan:
    fields = {"source": PlanSource.prepare_tool, "content": CONTENT, "arguments_hash": "a" * 64,
              "plan_id": "p-1", "target_version": 3, **kw}
    return new_plan(fields.pop("source"), fields.pop("content"), **fields)


def test_the_hash_is_sha256_of_the_canonical_json_of_its_four_parts() -> None:
    expected = sha256_hex({"source": "prepare_tool", "content": CONTENT, "target_version": 3,
                           "arguments_hash": "a" * 64})
    assert _plan().hash == expected == plan_hash(PlanSource.prepare_tool, CONTENT, 3, "a" * 64)
    # Key order is not content: the canonical form sorts keys.
    reordered = {"target_version": 3, "changes": [{"after": "closed", "before": "open", "field": "status"}]}
    assert _plan(content=reordered).hash == expected


@pytest.mark.parametrize("change", [
    {"source": PlanSource.precondition_snapshot}, {"content": {**CONTENT, "target_version": 4}},
    {"target_version": 4}, {"target_version": "3"}, {"arguments_hash": "b" * 64},
])
def test_each_hashed_part_changes_the_hash(change: dict) -> None:
    assert _plan(**change).hash != _plan().hash


def test_the_plan_id_is_a_label_not_hashed() -> None:
    assert _plan(plan_id="p-2").hash == _plan().hash


def test_what_the_ledger_keeps_of_a_plan() -> None:
    plan = _plan()
    assert plan.as_evidence() == {"source": "prepare_tool", "plan_id": "p-1", "plan_hash": plan.hash,
                                  "target_version": 3, "content": CONTENT}


def test_check_plan_accepts_the_approved_plan_and_names_what_differs() -> None:
    approved = _plan()
    check_plan(approved.hash, 3, _plan())  # the same plan prepared again: no refusal
    with pytest.raises(PlanChanged) as raised:
        check_plan(approved.hash, 3, _plan(content={**CONTENT, "changes": []}))
    assert raised.value.context["changed"] == "hash"
    with pytest.raises(PlanChanged) as raised:
        check_plan(approved.hash, 3, _plan(target_version=4, content={**CONTENT, "target_version": 4}))
    error = raised.value
    assert (error.code, error.context["changed"]) == ("plan_changed", "hash,target_version")
    assert error.context["approved_target_version"] == 3 and error.context["fresh_target_version"] == 4
    assert error.context["approved_hash"] == approved.hash != error.context["fresh_hash"]
    # The target version alone differs (the approval recorded another one): refused too.
    with pytest.raises(PlanChanged) as raised:
        check_plan(approved.hash, 2, _plan())
    assert raised.value.context["changed"] == "target_version"


def test_plan_changed_is_a_terminal_revalidation_refusal_that_pickles() -> None:
    error = PlanChanged("differs", changed="hash")
    assert isinstance(error, RevalidationFailed) and not error.retryable
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), again.code, again.context) == (PlanChanged, "plan_changed", {"changed": "hash"})
    failed = PrepareFailed("down")
    assert isinstance(failed, TargetReadFailed) and failed.retryable and failed.code == "prepare_failed"


def test_plan_diff_names_the_paths_that_differ() -> None:
    old = {"target_version": 3, "changes": [{"field": "version", "before": 3, "after": 4}], "note": "x"}
    new = {"target_version": 4, "changes": [{"field": "version", "before": 4, "after": 5},
                                            {"field": "status", "before": "open", "after": "closed"}],
           "applicable": True}
    assert plan_diff(old, new) == [
        {"path": "target_version", "old": 3, "new": 4},
        {"path": "changes.0.before", "old": 3, "new": 4},
        {"path": "changes.0.after", "old": 4, "new": 5},
        {"path": "changes.1", "old": None, "new": {"field": "status", "before": "open", "after": "closed"},
         "missing": "old"},
        {"path": "note", "old": "x", "new": None, "missing": "new"},
        {"path": "applicable", "old": None, "new": True, "missing": "old"},
    ]
    assert plan_diff(old, old) == []


def test_plan_diff_sees_a_type_change_and_stops_at_its_limit() -> None:
    assert plan_diff({"a": 1}, {"a": True}) == [{"path": "a", "old": 1, "new": True}]
    assert plan_diff({"a": {"b": 1}}, {"a": [1]}) == [{"path": "a", "old": {"b": 1}, "new": [1]}]
    wide_old, wide_new = {str(i): i for i in range(100)}, {str(i): -i - 1 for i in range(100)}
    assert len(plan_diff(wide_old, wide_new)) == 50 and len(plan_diff(wide_old, wide_new, limit=7)) == 7


def _close_contract(**prepare) -> dict:
    raw = yaml.safe_load((CONTRACTS / "ticket.close.yaml").read_text())
    raw["prepare"] = {**raw["prepare"], **prepare}
    return raw


def test_the_shipped_contracts_prepare_through_their_preview_tools() -> None:
    close, refund = contract_for(CONTRACTS, "ticket.close"), contract_for(CONTRACTS, "refund.issue")
    assert (close.prepare.tool, refund.prepare.tool) == ("preview_close_ticket", "preview_refund")
    where = dict(close._expressions())
    assert where["prepare.arguments.ticket_id"] == "args.ticket_id"
    assert where["prepare.plan_id"] == "plan.plan_id" and where["prepare.target_version"] == "plan.target_version"
    assert contract_for(CONTRACTS, "ticket.create").prepare is None  # no prepare tool: the snapshot plan


@pytest.mark.parametrize(("prepare", "refusal"), [
    ({"target_version": "plan.target_version +"}, "prepare.target_version"),
    ({"plan_id": "plan.("}, "prepare.plan_id"),
    ({"arguments": {"ticket_id": "args.ticket_id ==="}}, "prepare.arguments.ticket_id"),
    ({"tool": "close_ticket"}, "is the write tool"),
    ({"plan_version": "plan.target_version"}, "plan_version"),
])
def test_a_bad_prepare_block_is_refused_naming_the_field(tmp_path: Path, prepare: dict, refusal: str) -> None:
    path = tmp_path / "ticket.close.yaml"
    path.write_text(yaml.safe_dump(_close_contract(**prepare)))
    with pytest.raises((ValueError, ConditionError)) as raised:
        load_contract(path)
    assert refusal in str(raised.value)


def test_a_prepare_block_needs_a_tool() -> None:
    raw = _close_contract()
    del raw["prepare"]["tool"]
    with pytest.raises(ValueError, match="prepare.tool"):
        Contract.model_validate(raw)


def test_pinning_records_the_prepare_tool_and_names_a_missing_one(tmp_path: Path) -> None:
    close = contract_for(CONTRACTS, "ticket.close")
    live = {"close_ticket": "a" * 64, "preview_close_ticket": "b" * 64, "get_ticket": "c" * 64}
    pin, unknown = pin_server([close], "1.0.0", live, "rev")
    assert unknown == {} and pin.tools == {"close_ticket": "a" * 64, "preview_close_ticket": "b" * 64,
                                           "get_ticket": "c" * 64}
    assert problems({"sor": pin}, {"ticket.close": close}, tmp_path / "pins.json") == {}

    typo = close.model_copy(update={"prepare": close.prepare.model_copy(update={"tool": "preview_close_tiket"})})
    pin, unknown = pin_server([typo], "1.0.0", live, "rev")
    assert "no tool 'preview_close_tiket' (prepare.tool)" in unknown["ticket.close"]
    code, detail = problems({"sor": pin}, {"ticket.close": typo}, tmp_path / "pins.json")["ticket.close"]
    assert code == "unknown_tool" and "preview_close_tiket" in detail
    # Listed by the server but never pinned (an old pins file): a missing pin, not an unknown tool.
    old = pin_server([contract_for(CONTRACTS, "ticket.create").model_copy(update={"tool": "close_ticket"})],
                     "1.0.0", live, "rev")[0]
    assert problems({"sor": old}, {"ticket.close": close}, tmp_path / "p.json")["ticket.close"][0] == \
        "contract_not_pinned"
