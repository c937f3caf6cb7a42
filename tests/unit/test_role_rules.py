"""The legal-transition table (ledger/roles.py, installed by migration 0003) against the code that
moves actions: every ``transition_txn`` call whose statuses are written out in worker/ and
recovery/ must name only moves the table allows, or Postgres would refuse it at run time."""

from __future__ import annotations

import ast

from ledger.roles import ACTION_TRANSITIONS, EVENT_RIGHTS, OPERATOR_EVENT_PREFIXES
from ledger.states import ActionStatus
from proofline.settings import ROOT

LEGAL = {(t.from_status, t.to_status) for t in ACTION_TRANSITIONS}


def _status(node: ast.AST, constants: dict[str, list[str]]) -> list[str] | None:
    """``ActionStatus.x`` -> ["x"]; a module constant tuple of them -> its members; else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ActionStatus":
        return [ActionStatus[node.attr].value]
    if isinstance(node, ast.List | ast.Tuple):
        values = [_status(e, constants) for e in node.elts]
        return None if any(v is None for v in values) else [x for v in values for x in v]  # type: ignore[union-attr]
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    return None


def written_moves() -> list[tuple[str, str, str]]:
    moves = []
    for path in sorted([*(ROOT / "worker").glob("*.py"), *(ROOT / "recovery").glob("*.py")]):
        tree = ast.parse(path.read_text())
        constants: dict[str, list[str]] = {}
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                value = _status(stmt.value, {})
                if value is not None:
                    constants[stmt.targets[0].id] = value
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "transition_txn":
                allowed, target = _status(node.args[2], constants), _status(node.args[3], constants)
                if allowed is None or target is None:
                    continue  # the target is computed (a verdict's status): covered by the integration tests
                moves += [(f"{path.name}:{node.lineno}", a, t) for a in allowed for t in target]
    return moves


def test_every_written_move_is_in_the_table():
    moves = written_moves()
    assert len(moves) >= 15, moves  # the scan is live: it finds the calls
    illegal = [m for m in moves if (m[1], m[2]) not in LEGAL]
    assert illegal == []


def test_a_move_the_table_lacks_is_reported():
    """The comparison above can fail: a move nobody may make is not in the table."""
    assert ("closed", "executing") not in LEGAL and ("cancelled", "published") not in LEGAL


def test_reserved_event_names_are_events_the_code_appends():
    """Every event name given to a role is one the code (or the operator namespace) really uses."""
    source = "\n".join(p.read_text() for d in ("worker", "recovery", "proofline", "ledger")
                       for p in (ROOT / d).rglob("*.py") if not p.name.startswith("roles"))
    unused = [e for e, _ in EVENT_RIGHTS if f'"{e}"' not in source and f"'{e}'" not in source]
    assert unused == []
    assert OPERATOR_EVENT_PREFIXES == ("manual\\_%",)
