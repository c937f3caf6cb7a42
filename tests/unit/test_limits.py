"""Containment without services: the static CEL limits, evaluation failures as recorded errors,
per-file contract loading and ``proofline contracts check``, envelope limits, result bounds."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner
from mcp.types import CallToolResult, TextContent

from ledger.states import Outcome
from proofline import cel_watchdog
from proofline.cel_limits import ConditionLimits, check, measure
from proofline.cli import main
from proofline.conditions import compile_expression, evaluate, evaluate_here, holds
from proofline.contracts import contract_for, load_contracts
from proofline.envelope import build_envelope
from proofline.errors import (
    AuthorityBudgetExceeded,
    ConditionError,
    ConditionInputTooLarge,
    ConditionInvalid,
    ConditionTooComplex,
    ContractInvalid,
    DeadlineTooFar,
    RevalidationFailed,
)
from proofline.settings import Settings
from worker.bounded_stdio import _Line
from worker.classify import CallReport, classify
from worker.limits import check_limits
from worker.results import measure as measure_result
from worker.stdio_lines import MESSAGE_TOO_LARGE

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = ROOT / "contracts"
UNLIMITED = ConditionLimits(max_chars=10**7, max_depth=10**7, max_operators=10**7, max_operands=10**7,
                            max_comprehensions=10**3, max_comprehension_depth=10**3)


# --- the static scanner -------------------------------------------------------------------------


@pytest.mark.parametrize("source", [
    "before.found",
    "before.account.version == target.expected_version",
    "before.refunds.exists(r, r.id == args.refund_id && r.status == 'issued')",
    "size(after.refunds) == 1 && after.refund.amount_cents == args.amount_cents",
    "after.generation >= target.expected_version + 1 && after.generation <= target.expected_version + 2",
])
def test_every_shipped_style_of_condition_passes(source):
    check(source)


def test_every_shipped_contract_condition_is_within_the_limits():
    loaded = load_contracts(CONTRACTS)
    assert loaded.broken == {} and len(loaded.contracts) == 5


@pytest.mark.parametrize(("source", "limit"), [
    (" + ".join("1" for _ in range(15_000)) + " > 0", "max_chars"),
    ("(" * 120_000 + "1" + ")" * 120_000, "max_chars"),
    ("(" * 13 + "1" + ")" * 13 + " == 1", "max_depth"),
    ("[" * 13 + "1" + "]" * 13 + " == []", "max_depth"),
    (" + ".join("1" for _ in range(65)) + " > 0", "max_operators"),
    ("a" + ".b" * 70, "max_operators"),
    ("!" * 70 + "true", "max_operators"),
    ("[" + ",".join("1" for _ in range(65)) + "] == []", "max_operands"),
    ("[1].map(x, [1].map(y, y)) == []", "max_comprehension_depth"),
    ("[1].all(x, [2] .exists (y, x == y))", "max_comprehension_depth"),
    ("[1].all(x, true) && [1].all(x, true) && [1].all(x, true)", "max_comprehensions"),
])
def test_bombs_are_refused_before_the_library_sees_them(source, limit):
    with pytest.raises(ConditionTooComplex) as err:
        compile_expression(source)
    assert err.value.code == "condition_too_complex"
    assert err.value.context["limit"] == limit


def test_scanner_ignores_brackets_and_operators_inside_strings():
    shape = measure("args.note == '((((((((((((((( + + + [[[[ .map(' && r'\\d((' != \"\"\"))))\"\"\"")
    assert (shape.depth, shape.comprehensions) == (0, 0)
    assert shape.operators == 4  # ., ==, &&, !=
    check("args.note == '" + "(" * 200 + "'")


def test_scanner_is_iterative_and_linear_on_hostile_text():
    # Far past any recursion limit, and not refused by length when the limit is lifted.
    shape = measure("(" * 300_000 + ")" * 300_000)
    assert shape.depth == 300_000


def test_comprehension_shapes_are_counted():
    shape = measure("args.items.filter(i, i.qty > 0).map(i, i.qty).exists(q, q > 5)")
    assert (shape.comprehensions, shape.comprehension_depth) == (3, 1)
    assert measure("has(a.b) && size(a.c) > 0").comprehensions == 0


# --- evaluation -----------------------------------------------------------------------------------


def test_a_native_panic_becomes_a_condition_error():
    """120k parentheses make the Rust parser panic (a BaseException); with the limits lifted the
    panic must still come back as a ConditionError, never escape as a BaseException."""
    bomb = "(" * 120_000 + "1" + ")" * 120_000 + " == 1"
    with pytest.raises(ConditionError) as err:
        compile_expression(bomb, UNLIMITED)
    assert "PanicException" in err.value.detail or "parse" in err.value.detail.lower()


@pytest.mark.parametrize("source", ["1 / 0 == 1", "[1][5] == 1", "9223372036854775807 + 1 > 0", "int(1e300) > 0",
                                    "'a'.matches('(')"])
def test_every_library_error_is_a_condition_error(source):
    with pytest.raises(ConditionError):
        holds(source, {})


def test_comprehension_input_is_bounded():
    items = {"args": {"items": list(range(1001))}}
    with pytest.raises(ConditionInputTooLarge):
        holds("args.items.exists(x, x == 3)", items)
    # The same list without a comprehension is fine (its cost does not multiply).
    assert holds("size(args.items) == 1001", items)
    assert holds("args.items.exists(x, x == 3)", {"args": {"items": list(range(1000))}})


def test_nested_input_lists_are_found_without_recursion():
    deep: list = [list(range(2000))]
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ConditionInputTooLarge):
        holds("[1].exists(x, x == 1)", {"before": deep})


def test_programs_are_compiled_once():
    from proofline.conditions import _compiled

    source = "args.n * 3 == 9"
    before = _compiled.cache_info()
    for _ in range(50):
        assert evaluate(source, {"args": {"n": 3}}) is True
    after = _compiled.cache_info()
    assert after.misses - before.misses == 1 and after.hits - before.hits >= 49


# --- contracts: one file at a time --------------------------------------------------------------


def _copy_contracts(tmp_path: Path) -> Path:
    target = tmp_path / "contracts"
    shutil.copytree(CONTRACTS, target)
    return target


def test_a_bad_contract_refuses_only_its_own_action_type(tmp_path):
    directory = _copy_contracts(tmp_path)
    path = directory / "ticket.close.yaml"
    bomb = " + ".join("1" for _ in range(100)) + " > 0"
    path.write_text(path.read_text().replace('expr: "before.found"', f'expr: "{bomb}"', 1))
    with pytest.raises(ContractInvalid) as err:
        contract_for(directory, "ticket.close")
    assert "ticket.close.yaml" in err.value.detail and "operators" in err.value.detail
    assert contract_for(directory, "ticket.create").tool == "create_ticket"
    assert contract_for(directory, "refund.issue").amount_cents == "args.amount_cents"


def test_contracts_check_cli(tmp_path):
    directory = _copy_contracts(tmp_path)
    runner = CliRunner()
    ok = runner.invoke(main, ["contracts", "check", "--dir", str(directory)])
    assert ok.exit_code == 0, ok.output
    assert ok.output.count("ok ") == 5
    (directory / "refund.reverse.yaml").write_text(
        (directory / "refund.reverse.yaml").read_text().replace(
            "r.id == args.refund_id && r.status == 'issued')",
            "[1].exists(y, y == 1) && r.status == 'issued')", 1))
    (directory / "broken.yaml").write_text("action_type: [unclosed\n")
    bad = runner.invoke(main, ["contracts", "check", "--dir", str(directory)])
    assert bad.exit_code == 1
    assert "refused  refund.reverse.yaml" in bad.output and "comprehension_depth" in bad.output
    assert "refused  broken.yaml" in bad.output
    assert bad.output.count("ok ") == 4


# --- envelope limits --------------------------------------------------------------------------------


def _envelope(**overrides):
    now = datetime.now(UTC)
    fields = dict(
        run_id="run-1", action_id="act-1", workflow_type="agent.ops", action_type="refund.issue",
        requester="r@example.com", workload_identity="agent:x", tenant="acme", environment="test",
        target={"type": "account", "id": "acct-1", "expected_version": 1}, operation="refund",
        arguments={"account": "acct-1", "tenant": "acme", "amount_cents": 1500, "reason": "x"},
        server={"name": "sor", "version": "1.0.0"}, tool={"name": "issue_refund", "contract_hash": "0" * 64},
        policy_version=5, approval={"id": "apr-1", "version": 1, "expires_at": now + timedelta(hours=1)},
        timeout_seconds=5, deadline=now + timedelta(minutes=10),
    )
    fields.update(overrides)
    return build_envelope(**fields)


REFUND = contract_for(CONTRACTS, "refund.issue")
SETTINGS = Settings(max_deadline_seconds=3600)


def test_limits_pass_within_bounds():
    now = datetime.now(UTC)
    evidence = check_limits(_envelope(authority_budget={"max_amount_cents": 1500}), REFUND, SETTINGS, now, None)
    assert evidence["amount_cents"] == 1500 and evidence["max_amount_cents"] == 1500


def test_a_thirty_day_deadline_is_refused():
    now = datetime.now(UTC)
    env = _envelope(deadline=now + timedelta(days=30))
    with pytest.raises(DeadlineTooFar) as err:
        check_limits(env, REFUND, SETTINGS, now, None)
    assert isinstance(err.value, RevalidationFailed) and err.value.code == "deadline_too_far"
    # Measured from publication, not from whenever the message happens to be delivered.
    env = _envelope(deadline=now + timedelta(minutes=50))
    with pytest.raises(DeadlineTooFar):
        check_limits(env, REFUND, SETTINGS, now + timedelta(minutes=30), now - timedelta(minutes=20))


def test_amount_over_the_budget_is_refused():
    env = _envelope(arguments={"account": "acct-1", "tenant": "acme", "amount_cents": 9_000_000, "reason": "x"},
                    authority_budget={"max_amount_cents": 100})
    with pytest.raises(AuthorityBudgetExceeded) as err:
        check_limits(env, REFUND, SETTINGS, datetime.now(UTC), None)
    assert err.value.context["scope"] == "action"


@pytest.mark.parametrize("amount", ["1500", -5, 1.5, True, None])
def test_an_unreadable_amount_is_refused(amount):
    env = _envelope(arguments={"account": "acct-1", "tenant": "acme", "amount_cents": amount, "reason": "x"},
                    authority_budget={"max_amount_cents": 10_000})
    with pytest.raises(AuthorityBudgetExceeded):
        check_limits(env, REFUND, SETTINGS, datetime.now(UTC), None)


def test_envelope_conditions_are_checked():
    bomb = " + ".join("1" for _ in range(15_000)) + " > 0"
    assert len(bomb) < 256 * 1024
    for field in ("preconditions", "expected_postconditions"):
        with pytest.raises(ConditionTooComplex):
            check_limits(_envelope(**{field: ("true", bomb)}), REFUND, SETTINGS, datetime.now(UTC), None)
    with pytest.raises(ConditionInvalid):
        check_limits(_envelope(preconditions=("1 +",)), REFUND, SETTINGS, datetime.now(UTC), None)


# --- results ---------------------------------------------------------------------------------------------


def test_an_oversize_result_is_an_unknown_outcome_with_digest_and_excerpt():
    create = contract_for(CONTRACTS, "ticket.create")
    data = {"ticket_id": "T-1", "status": "open", "version": 1, "padding": "x" * 300_000}
    result = CallToolResult(content=[TextContent(type="text", text="ok")], structured_content=data)
    verdict = classify(CallReport(sent=True, result=result), create, limit=256 * 1024)
    assert verdict.outcome == Outcome.unknown_outcome and verdict.reason_code == "result_too_large"
    assert verdict.values is None
    assert verdict.evidence["result_size"] == measure_result(result).size > 300_000
    assert len(verdict.evidence["result_excerpt"]) <= 1024
    small = CallToolResult(content=[TextContent(type="text", text="ok")], structured_content={**data, "padding": ""})
    assert classify(CallReport(sent=True, result=small), create, limit=256 * 1024).outcome == \
        Outcome.completed_unverified


# --- the watchdog around comprehensions ------------------------------------------------------------

SLOW = "args.items.exists(i, size(" + " + ".join(["args.s"] * 20) + ") < 0)"
SLOW_VARIABLES = {"args": {"items": list(range(1000)), "s": "x" * (200 * 1024)}}


def test_a_comprehension_past_its_budget_is_stopped_and_the_next_one_works():
    check(SLOW)  # inside every static limit
    started = time.monotonic()
    with pytest.raises(ConditionError) as err:
        evaluate(SLOW, SLOW_VARIABLES)
    assert err.value.context["watchdog"] == "_OverBudget"
    assert time.monotonic() - started < cel_watchdog.BUDGET_SECONDS + 3
    assert holds("args.items.exists(i, i == 999)", SLOW_VARIABLES)


def test_a_dead_helper_is_a_condition_error_and_is_replaced():
    assert holds("[1, 2].exists(x, x == 2)", {})
    helper = cel_watchdog._helper
    assert helper is not None
    killer = threading.Timer(0.3, lambda: os.kill(helper.proc.pid, signal.SIGKILL))
    killer.start()
    with pytest.raises(ConditionError) as err:
        evaluate(SLOW, SLOW_VARIABLES)
    killer.join()
    assert err.value.context["watchdog"] == "_HelperGone"
    assert holds("[1, 2].all(x, x > 0)", {})
    assert cel_watchdog._helper is not None and cel_watchdog._helper.proc.pid != helper.proc.pid


def test_a_new_helpers_start_is_not_part_of_the_evaluation_budget():
    """A budget far shorter than starting an interpreter and the CEL library: a new helper still
    answers, because the budget starts once it has said it is ready (a loaded host's slow start
    is never taken for an evaluation over budget)."""
    if cel_watchdog._helper is not None:
        cel_watchdog._helper.kill()
        cel_watchdog._helper = None
    assert cel_watchdog.evaluate_guarded("[1, 2].exists(x, x == 2)", {}, budget=0.05) is True


def test_comprehensions_give_the_same_answers_through_the_watchdog():
    variables = {"before": {"refunds": [{"id": "R-1", "status": "issued"}, {"id": "R-2", "status": "reversed"}]},
                 "args": {"refund_id": "R-2"}}
    for expr in ("before.refunds.exists(r, r.id == args.refund_id && r.status == 'reversed')",
                 "before.refunds.filter(r, r.status == 'issued').map(r, r.id) == ['R-1']",
                 "before.refunds.exists_one(r, r.id == 'R-1')"):
        assert evaluate(expr, variables) is True
        assert evaluate_here(expr, variables) is True
    with pytest.raises(ConditionError):
        evaluate("before.refunds.exists(r, r.missing == 1)", variables)


# --- the bounded stdio reader -------------------------------------------------------------------------


def test_a_small_message_is_parsed_as_the_sdk_would():
    line = _Line(1000)
    for part in (b'{"jsonrpc": "2.0", "id": 7, ', b'"result": {"content": []}}'):
        line.add(part)
    message = line.finish()
    assert message.message.id == 7


@pytest.mark.parametrize(("raw_id", "request_id"), [(b"12", 12), (rb'"req-\"x\"-1"', 'req-"x"-1')])
def test_an_oversize_message_becomes_an_error_for_its_request(raw_id, request_id):
    line = _Line(1000)
    line.add(b'{"jsonrpc":"2.0","id":' + raw_id + b',"result":{"x":"')
    for _ in range(100):
        line.add(b"y" * 10_000)
    line.add(b'"}}')
    assert line.parts == [] and line.size > 1_000_000
    error = line.finish().message
    assert error.error.code == MESSAGE_TOO_LARGE and error.id == request_id
    assert error.error.data["size"] == line.size and len(error.error.data["sha256"]) == 64
    assert len(error.error.data["excerpt"]) <= 1024


def test_an_oversize_message_without_an_id_is_dropped():
    line = _Line(10)
    line.add(b'{"jsonrpc":"2.0","method":"notifications/message","params":{"data":"' + b"z" * 100 + b'"}}')
    assert line.finish() is None
