"""Prepare against the real system-of-record server (stdio, sandboxed, and streamable HTTP), through
the read identity of the stack's servers file: the plan, its hash, ``plan_changed`` after the
target changed, the snapshot plan of a contract with no prepare tool, and a prepare that fails."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from proofline.errors import ConditionError, PlanChanged, PrepareFailed
from proofline.plan import PlanSource, check_plan, plan_diff
from proofline_kit import zygote
from proofline_kit.sor import store as sor
from proofline_kit.witness.placement import READ_SUFFIX
from tests.conftest import ROOT, Stack
from worker.mcp_client import close_sessions
from worker.plan import make_plan
from worker.runtime import Runtime

BOTH = pytest.mark.parametrize("stack", ["stdio", "http"], indirect=True)


@pytest.fixture
def rt(stack: Stack) -> Iterator[Runtime]:
    """This process as a worker of the stack: its settings, its servers file, its own MCP sessions."""
    yield Runtime(settings=stack.settings, pid=os.getpid())
    close_sessions()


def _close(stack: Stack):
    ticket = sor.put_ticket(stack.sor_db, "acme", "to close", "ops")
    version = sor.get_ticket(stack.sor_db, ticket)["ticket"]["version"]
    envelope = stack.envelope("ticket.close", arguments={"ticket_id": ticket, "expected_version": version},
                              target={"type": "ticket", "id": ticket, "expected_version": version})
    return ticket, envelope


def _all_effects(stack: Stack) -> int:
    return len(sor.effects(stack.sor_db))


@BOTH
def test_the_prepare_tool_gives_the_plan_through_the_read_identity_and_changes_nothing(
        stack: Stack, rt: Runtime) -> None:
    ticket, envelope = _close(stack)
    contract, server = rt.contract("ticket.close"), rt.server("sor")
    effects, row, mark = _all_effects(stack), sor.get_ticket(stack.sor_db, ticket), stack.witness.mark()
    plan = make_plan(rt, server, contract, envelope)
    again = make_plan(rt, server, contract, envelope)
    assert plan.source == PlanSource.prepare_tool and plan.plan_id == f"close_ticket:{ticket}@1"
    assert plan.target_version == 1 and plan.content["applicable"] is True
    assert plan.content["changes"] == [{"field": "status", "before": "open", "after": "closed"},
                                       {"field": "version", "before": 1, "after": 2}]
    assert again.hash == plan.hash and plan.arguments_hash == envelope.arguments_hash
    check_plan(plan.hash, plan.target_version, again)  # unchanged target: the approved plan still holds
    # Nothing was written: no effect, the ticket as it was; both calls went to the read identity.
    assert _all_effects(stack) == effects and sor.get_ticket(stack.sor_db, ticket) == row
    calls = stack.witness.calls(tool="preview_close_ticket", since=mark)
    assert [c.server for c in calls] == ["sor" + READ_SUFFIX] * 2


@BOTH
def test_a_changed_target_changes_the_plan_and_check_plan_refuses(stack: Stack, rt: Runtime) -> None:
    ticket, envelope = _close(stack)
    contract, server = rt.contract("ticket.close"), rt.server("sor")
    approved = make_plan(rt, server, contract, envelope)
    sor.bump_version(stack.sor_db, "ticket", ticket)  # somebody else updates the ticket after approval
    fresh = make_plan(rt, server, contract, envelope)
    assert fresh.hash != approved.hash and fresh.target_version == 2
    # The close would now be refused by the server itself, and the plan says so.
    assert (fresh.content["applicable"], fresh.content["refusal"], fresh.content["changes"]) == \
        (False, "version_conflict", [])
    with pytest.raises(PlanChanged) as raised:
        check_plan(approved.hash, approved.target_version, fresh)
    error = raised.value
    assert error.code == "plan_changed" and error.context["changed"] == "hash,target_version"
    assert (error.context["approved_target_version"], error.context["fresh_target_version"]) == (1, 2)
    paths = [d["path"] for d in plan_diff(approved.content, fresh.content)]
    assert {"plan_id", "target_version", "applicable", "refusal", "changes.0", "changes.1"} <= set(paths)


@BOTH
def test_the_refund_plan_shows_the_balance_before_and_after(stack: Stack, rt: Runtime) -> None:
    account = f"acct-plan-{os.getpid()}-{stack.transport}"
    sor.put_account(stack.sor_db, account, "acme", 10_000)
    envelope = stack.envelope("refund.issue", arguments={"account": account, "tenant": "acme", "amount_cents": 2500,
                                                         "reason": "sla"},
                              target={"type": "account", "id": account, "expected_version": 1})
    effects = _all_effects(stack)
    plan = make_plan(rt, rt.server("sor"), rt.contract("refund.issue"), envelope)
    assert plan.content["changes"][0] == {"field": "balance_cents", "before": 10_000, "after": 7_500}
    assert plan.target_version == 1 and _all_effects(stack) == effects
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 10_000


@BOTH
def test_without_a_prepare_tool_the_plan_is_the_precondition_snapshot(stack: Stack, rt: Runtime) -> None:
    ticket, envelope = _close(stack)
    contract = rt.contract("ticket.close").model_copy(update={"prepare": None})
    server = rt.server("sor")
    plan = make_plan(rt, server, contract, envelope)
    assert plan.source == PlanSource.precondition_snapshot and plan.plan_id is None and plan.target_version is None
    assert plan.content["read"] == "get_ticket" and plan.content["arguments"] == envelope.arguments
    assert plan.content["before"]["ticket"]["id"] == ticket and plan.content["before"]["ticket"]["version"] == 1
    assert make_plan(rt, server, contract, envelope).hash == plan.hash
    sor.bump_version(stack.sor_db, "ticket", ticket)
    fresh = make_plan(rt, server, contract, envelope)
    with pytest.raises(PlanChanged) as raised:
        check_plan(plan.hash, plan.target_version, fresh)
    assert raised.value.context["changed"] == "hash"
    assert {"path": "before.ticket.version", "old": 1, "new": 2} in plan_diff(plan.content, fresh.content)


def test_a_prepare_that_fails_is_retryable_and_a_mapping_that_cannot_be_built_is_not(
        stack: Stack, rt: Runtime) -> None:
    ticket, envelope = _close(stack)
    contract, server = rt.contract("ticket.close"), rt.server("sor")

    def with_prepare(**update):
        return contract.model_copy(update={"prepare": contract.prepare.model_copy(update=update)})

    with pytest.raises(PrepareFailed) as raised:  # the server has no such tool
        make_plan(rt, server, with_prepare(tool="preview_close_tiket"), envelope)
    assert raised.value.retryable and "preview_close_tiket" in raised.value.detail
    # A write tool named as the prepare tool runs on the read identity, which refuses it: no effect.
    effects = _all_effects(stack)
    with pytest.raises(PrepareFailed) as raised:
        make_plan(rt, server, with_prepare(tool="create_ticket",
                                           arguments={"tenant": "'acme'", "title": "'x'", "owner": "'ops'"}), envelope)
    assert "read-only identity" in raised.value.detail and _all_effects(stack) == effects
    # The answer lacks what the contract reads out of it: not a usable plan.
    with pytest.raises(PrepareFailed) as raised:
        make_plan(rt, server, with_prepare(target_version="plan.serial"), envelope)
    assert raised.value.context["unreadable"] is True and "target_version" in raised.value.detail
    # The contract's mapping does not fit the envelope: asking again cannot help.
    with pytest.raises(ConditionError) as refused:
        make_plan(rt, server, with_prepare(arguments={"ticket_id": "args.ticket", "expected_version": "1"}),
                  envelope)
    assert not refused.value.retryable and "preview_close_ticket arguments" in refused.value.detail
    assert sor.get_ticket(stack.sor_db, ticket)["ticket"]["version"] == 1


def test_a_plan_canonical_json_cannot_write_is_prepare_failed(stack: Stack, rt: Runtime) -> None:
    # A balance beyond 2**53: JSON carries it, RFC 8785 cannot write it, so nobody could approve its hash.
    account = f"acct-huge-{os.getpid()}"
    sor.put_account(stack.sor_db, account, "acme", 2**60)
    envelope = stack.envelope("refund.issue", arguments={"account": account, "tenant": "acme", "amount_cents": 100,
                                                         "reason": "sla"},
                              target={"type": "account", "id": account, "expected_version": 1})
    with pytest.raises(PrepareFailed) as raised:
        make_plan(rt, rt.server("sor"), rt.contract("refund.issue"), envelope)
    assert "cannot be hashed" in raised.value.detail and raised.value.context["unreadable"] is True


def test_contracts_check_refuses_a_misspelled_prepare_tool(tmp_path: Path) -> None:
    contracts = tmp_path / "contracts"
    contracts.mkdir()
    for source in (ROOT / "contracts").glob("*.yaml"):
        (contracts / source.name).write_text(source.read_text())
    raw = yaml.safe_load((contracts / "ticket.close.yaml").read_text())
    raw["prepare"]["tool"] = "preview_close_tiket"
    (contracts / "ticket.close.yaml").write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")}
    env.update(PYTHONPATH=str(ROOT), PROOFLINE_PINS_FILE=str(ROOT / "contracts" / "pins.json"))

    def check(directory: Path) -> subprocess.CompletedProcess[str]:
        return zygote.run([sys.executable, "-m", "proofline", "contracts", "check", "--dir", str(directory)],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    refused = check(contracts)
    assert refused.returncode == 1, refused.stderr
    assert "unknown_tool  ticket.close: server 'sor' has no tool 'preview_close_tiket' (prepare.tool)" \
        in refused.stderr
    assert "refund.issue" not in refused.stderr  # the other contracts are fine
    shipped = check(ROOT / "contracts")
    assert shipped.returncode == 0 and shipped.stderr == "", shipped.stderr
