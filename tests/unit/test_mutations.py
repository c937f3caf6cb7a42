"""The mutation list stays true to the tree: every entry's snippet is in its file exactly once, every
named test exists, and the rotation is deterministic and covers the whole list in turn."""

from __future__ import annotations

import ast

import pytest

from ops import mutation_check
from ops.mutation_check import ROOT, load, occurrences, rotation

ENTRIES = load()
#: The protections the list must cover (issue 22): an entry's id starts with one of these.
REQUIRED = ("publish-payload-conflict", "record-payload-conflict", "claim-lease", "result-stage-fencing",
            "precondition-version", "duplicate-", "in-progress-reconcile", "prohibited-finding", "chain-content-hash",
            "chain-links", "checkpoint-signature", "envelope-signature", "approval-signature", "recovery-parent-link",
            "kill-switch", "identity-revocation", "approval-revocation", "deadline", "amount-budget", "sandbox-refusal")


@pytest.mark.parametrize("entry", ENTRIES, ids=[m.id for m in ENTRIES])
def test_every_snippet_is_in_its_file_exactly_once(entry) -> None:
    assert occurrences(entry) == 1, f"{entry.id}: stale entry, fix ops/mutations.yaml"
    mutated = (ROOT / entry.file).read_text().replace(entry.snippet, entry.mutant, 1)
    if entry.file.endswith(".py"):
        ast.parse(mutated)  # a mutant that does not parse would be 'caught' for the wrong reason


@pytest.mark.parametrize("entry", ENTRIES, ids=[m.id for m in ENTRIES])
def test_every_named_test_exists(entry) -> None:
    for node in entry.tests:
        path, _, name = node.partition("::")
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{entry.id}: {node} is not a test function"


def test_the_list_covers_every_promised_protection() -> None:
    ids = [m.id for m in ENTRIES]
    assert [r for r in REQUIRED if not any(i.startswith(r) for i in ids)] == []


def test_rotation_is_deterministic_and_comes_round() -> None:
    assert rotation(ENTRIES, 2, "abc") == rotation(ENTRIES, 2, "abc")
    seen = {m.id for seed in range(200) for m in rotation(ENTRIES, 2, str(seed))}
    assert seen == {m.id for m in ENTRIES}
    assert len(rotation(ENTRIES, 3, "x")) == 3
    assert rotation(ENTRIES, len(ENTRIES) + 5, "x") == sorted(ENTRIES, key=lambda m: m.id)


def test_junit_outcomes_are_read_per_named_test(tmp_path) -> None:
    report = tmp_path / "r.xml"
    report.write_text("""<testsuites><testsuite>
      <testcase classname="tests.unit.test_a" name="test_ok[x]"/>
      <testcase classname="tests.unit.test_a" name="test_ok[y]"/>
      <testcase classname="tests.unit.test_a" name="test_red"><failure message="no"/></testcase>
      <testcase classname="tests.unit.test_a" name="test_half[x]"/>
      <testcase classname="tests.unit.test_a" name="test_half[y]"><error message="no"/></testcase>
      <testcase classname="tests.unit.test_a" name="test_skip"><skipped message="no"/></testcase>
    </testsuite></testsuites>""")
    named = ["tests/unit/test_a.py::test_ok", "tests/unit/test_a.py::test_red", "tests/unit/test_a.py::test_half",
             "tests/unit/test_a.py::test_never_ran", "tests/unit/test_a.py::test_skip"]
    assert mutation_check.outcomes(report, named) == dict(zip(
        named, ["passed", "failed", "failed", "not run", "not run"], strict=True))
