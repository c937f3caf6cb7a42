"""A contract's CEL programs are compiled once per contract digest (proofline/conditions.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from proofline import conditions
from proofline.contracts import load_contract
from proofline.settings import get_settings


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every expression handed to the CEL compiler from now on."""
    seen: list[str] = []
    real = conditions.cel.compile

    def counting(source: str) -> Any:
        seen.append(source)
        return real(source)

    monkeypatch.setattr(conditions.cel, "compile", counting)
    return seen


def write_contract(tmp_path: Path, name: str, **changes: Any) -> Path:
    raw = yaml.safe_load((get_settings().contracts_dir / "ticket.create.yaml").read_text())
    raw.update(changes)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_contract_is_compiled_once_per_digest(tmp_path: Path, compiles: list[str]) -> None:
    contract = load_contract(write_contract(tmp_path, "a.yaml", timeout_seconds=7.25))
    first = contract.compiled()
    assert first.digest == contract.digest
    assert compiles, "a contract not seen before is compiled"
    compiled_then = len(compiles)
    # Loaded again (another object, the same digest): the same programs, nothing compiled.
    again = load_contract(write_contract(tmp_path, "b.yaml", timeout_seconds=7.25))
    assert again is not contract and again.digest == contract.digest
    assert again.compiled() is first
    assert len(compiles) == compiled_then


def test_a_changed_contract_is_compiled_again(tmp_path: Path, compiles: list[str]) -> None:
    base = load_contract(write_contract(tmp_path, "a.yaml", timeout_seconds=8.5))
    old = base.compiled()
    precondition = base.preconditions[0].model_dump()
    changed_expr = f"({precondition['expr']}) && args.title != 'forbidden'"
    changed = load_contract(write_contract(tmp_path, "b.yaml", timeout_seconds=8.5,
                                           preconditions=[{**precondition, "expr": changed_expr}]))
    assert changed.digest != base.digest
    start = len(compiles)
    new = changed.compiled()
    assert new is not old and changed_expr in new.programs and changed_expr not in old.programs
    assert changed_expr in compiles[start:]


def test_the_cache_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conditions, "CONTRACTS_KEPT", 2)
    digests = []
    for i in range(3):
        contract = load_contract(write_contract(tmp_path, f"c{i}.yaml", timeout_seconds=3.0 + i / 8))
        contract.compiled()
        digests.append(contract.digest)
    assert digests[0] not in conditions._by_digest
    assert all(d in conditions._by_digest for d in digests[1:])


VALUES = {"args": {"a": 1, "s": "x", "l": [1, 2, 3], "f": 1.5, "n": None, "d": {"k": True}},
          "before": {"found": False}}


@pytest.mark.parametrize("expr", ["args.a == 1", "args.s + 'y'", "size(args.l)", "args.f * 2.0", "args.n == null",
                                  "args.d.k && !before.found", "args.missing", "args.a / 0",
                                  "args.l.exists(x, x == 2)"])
def test_bound_variables_evaluate_as_the_plain_mapping_does(expr: str) -> None:
    def run(variables: Any) -> tuple[str, Any]:
        try:
            return "value", conditions.evaluate(expr, variables)
        except conditions.ConditionError as exc:
            return "error", exc.code

    assert run(conditions.Variables(VALUES)) == run(VALUES)


def test_bound_variables_are_converted_once() -> None:
    bound = conditions.Variables(VALUES)
    assert conditions.holds("args.a == 1", bound)
    first = bound.context()
    assert not conditions.holds("before.found", bound)
    assert bound.context() is first


def test_only_the_variables_an_expression_names_are_converted() -> None:
    # A value CEL cannot convert shows whether a variable was converted at all.
    bound = conditions.Variables({"args": {"a": 1}, "envelope": {"bad": object()}})
    assert conditions.holds("args.a == 1", bound)
    with pytest.raises(conditions.ConditionError):
        conditions.holds("envelope.bad == 1", bound)
    assert conditions.holds("args.a == 1", bound)  # the failed conversion left the shared context intact
