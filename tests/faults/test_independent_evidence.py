"""Independent evidence, through the product: real workers, the system of record's MCP server and
the audit system's (its own process, its own store, fed from the system of record's effects after
a delay), both sandboxed over stdio.

- A refund is confirmed by the audit log and a restart through the monitoring view; each read is its
  own ``evidence_read`` record, made through each server's read identity.
- A system of record that lies consistently (it records the change and reads it back, but never
  makes it) is caught by the audit source: ``evidence_conflict``, escalated, nothing compensated or
  called again.
- With contracts of the test's own: a quorum met while one source misses, a quorum missed, and a
  source that cannot be read leaving the confidence too low: not verified.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ledger.states import ActionStatus, Outcome
from proofline.commands import exit_codes
from proofline.settings import ROOT
from proofline_kit.sor import store as sor
from tests.conftest import Stack, build_stack, start_workers, teardown_stack
from tests.helpers import evidence_of, new_account, refund_env, restart_env, ticket_env
from tests.integration.cli_run import proofline

AUDIT = {"server": "audit", "tool": "find_audit_entries", "arguments": {"idempotency_key": "envelope.idempotency_key"},
         "consistency_delay_seconds": 2, "expected": ["after.count == 1"], "absent": "after.count == 0"}


def readings(stack: Stack, action_id: str) -> dict[str, dict[str, Any]]:
    """The action's evidence records by source (the last verification's, when there were several)."""
    return {r["source"]: r for r in evidence_of(stack, action_id, "evidence_read")}


def compensations(stack: Stack, action_id: str) -> int:
    with stack.conn.cursor() as cur:
        cur.execute("SELECT count(*) AS n FROM actions WHERE parent_action_id = %s", (action_id,))
        return cur.fetchone()["n"]


def conflicted(stack: Stack, tool: str, env) -> dict[str, dict[str, Any]]:
    """Publish ``env`` with ``tool`` lying consistently; asserts the conflict, returns the readings."""
    row = under_fault(stack, tool, "lie_consistently", env)
    assert (row.status, row.finding, row.reason_code) == (ActionStatus.escalated, "evidence_conflict",
                                                          "evidence_conflict")
    return readings(stack, env.action_id)


def under_fault(stack: Stack, tool: str, mode: str, env) -> Any:
    sor.set_fault(stack.sor_db, tool, mode, remaining=1)
    try:
        stack.publish(env)
        return stack.wait_settled(env.action_id, timeout=60)
    finally:
        sor.clear_faults(stack.sor_db, tool)


# --- the demo's contracts, on the shared stack ------------------------------------------------------


def test_a_refund_is_confirmed_by_the_audit_log(stack: Stack) -> None:
    env = refund_env(stack, new_account(stack))
    start = stack.witness.mark()
    stack.publish(env)
    row = stack.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome, row.finding) == (ActionStatus.closed, Outcome.completed_verified, "expected")
    found = readings(stack, env.action_id)
    assert set(found) == {"primary", "audit"}
    assert (found["primary"]["server"], found["primary"]["tool"]) == ("sor", "find_refund_by_key")
    audit = found["audit"]
    assert (audit["server"], audit["identity"], audit["tool"], audit["finding"]) == (
        "audit", "read", "find_audit_entries", "expected")
    assert audit["after"]["entries"][0]["detail"]["amount_cents"] == env.arguments["amount_cents"]
    assert audit["latency_ms"] >= 0 and audit["reads"] >= 1
    # Read through the audit server's read identity, as the witness in front of it saw.
    assert stack.witness.count(tool="find_audit_entries", server="audit:read", since=start) == audit["reads"]
    [finished] = evidence_of(stack, env.action_id, "verification_finished")
    assert finished["evidence"]["met"] is True and finished["evidence"]["confirming"] == ["audit", "primary"]


def test_a_restart_is_verified_through_the_monitoring_view(stack: Stack) -> None:
    env = restart_env(stack)
    stack.publish(env)
    row = stack.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
    found = readings(stack, env.action_id)
    assert found["monitoring"]["finding"] == "expected" and found["monitoring"]["server"] == "audit"
    [restart] = found["monitoring"]["after"]["restarts"]
    assert restart["idempotency_key"] == env.idempotency_key


def test_a_restart_monitoring_never_saw_is_not_verified_though_the_service_says_so(stack: Stack) -> None:
    env = restart_env(stack)
    found = conflicted(stack, "restart_service", env)
    # The service's own status passed: this is what would have been verified without the monitoring view.
    assert found["primary"]["finding"] == "expected"
    assert found["monitoring"]["finding"] == "absent" and found["monitoring"]["after"]["restarts"] == []
    assert stack.effects(env.idempotency_key) == 0


def test_a_system_of_record_lying_consistently_is_caught_by_the_audit_log(stack: Stack) -> None:
    account = new_account(stack)
    env = refund_env(stack, account)
    start = stack.witness.mark()
    row = under_fault(stack, "issue_refund", "lie_consistently", env)
    assert (row.status, row.outcome, row.finding, row.reason_code) == (
        ActionStatus.escalated, Outcome.completed_unverified, "evidence_conflict", "evidence_conflict")
    # The lie is consistent: the system of record's record and its own read show the refund...
    assert sor.find_refund_by_key(stack.sor_db, env.idempotency_key)["found"] is True
    found = readings(stack, env.action_id)
    assert found["primary"]["finding"] == "expected" and found["primary"]["after"]["found"] is True
    # ...the audit log, fed from what was really done, never saw it; every reading is kept.
    assert found["audit"]["finding"] == "absent" and found["audit"]["after"]["count"] == 0
    assert stack.effects(env.idempotency_key) == 0
    [escalated] = evidence_of(stack, env.action_id, "escalated")
    assert escalated["reason_code"] == "evidence_conflict"
    # Nothing is undone or tried again on a guess: one call, no compensation, no recovery decision.
    assert stack.witness.count(tool="issue_refund", since=start) == 1
    assert compensations(stack, env.action_id) == 0
    assert "recovery_decided" not in stack.events(env.action_id)


def test_contracts_check_knows_the_servers_and_tools_of_the_sources(stack: Stack, tmp_path: Path) -> None:
    """Offline: a source on a server the servers file lacks, and a source tool its pinned server
    does not list, each fail ``proofline contracts check`` with its own code."""
    folder = tmp_path / "contracts"
    shutil.copytree(ROOT / "contracts", folder)
    assert proofline(stack, "contracts", "check", "--dir", str(folder)).returncode == 0
    refund, restart = folder / "refund.issue.yaml", folder / "service.restart.yaml"
    refund.write_text(refund.read_text().replace("server: audit", "server: billing"))
    restart.write_text(restart.read_text().replace("tool: service_restarts", "tool: service_restartz"))
    out = proofline(stack, "contracts", "check", "--dir", str(folder))
    assert out.returncode == exit_codes.CHECK_FAILED
    problems = {line.split()[1].rstrip(":"): line.split()[0] for line in out.stderr.splitlines()}
    assert problems == {"refund.issue": "unknown_server", "service.restart": "unknown_tool"}, out.stderr
    assert "service_restartz" in out.stderr and "'billing'" in out.stderr


# --- policies of the test's own, on a stack of their own --------------------------------------------


def own_contracts(directory: Path) -> Path:
    """The project's contracts with other evidence policies:

    - refund.issue: a quorum of 2 of 3 (the record, the audit log, the account balance), and the
      audit search to reconcile an unknown outcome while the record cannot be read;
    - ticket.create: a quorum of 2 of 3 (the record and two audit tools);
    - service.restart: the monitoring view must confirm, plus a billing source on a server the
      servers file does not have, with a required confidence of 0.9."""
    shutil.copytree(ROOT / "contracts", directory)

    def edit(name: str, sources: list[dict[str, Any]], evidence: dict[str, Any]) -> None:
        path = directory / f"{name}.yaml"
        spec = yaml.safe_load(path.read_text())
        spec["verification"]["sources"] = sources
        spec["verification"]["evidence"] = evidence
        path.write_text(yaml.safe_dump(spec, sort_keys=False))

    balance = {"name": "balance", "tool": "get_account", "arguments": {"account": "target.id"},
               "expected": ["after.account.balance_cents == before.account.balance_cents - args.amount_cents"]}
    edit("refund.issue", [{"name": "audit", **AUDIT}, balance], {"rule": "quorum", "quorum": 2})
    refund = directory / "refund.issue.yaml"
    spec = yaml.safe_load(refund.read_text())
    spec["verification"]["reconcile"] = {**AUDIT, "name": "audit_search", "tool": "search_audit",
                                         "prohibited": ["after.count > 1"]}
    refund.write_text(yaml.safe_dump(spec, sort_keys=False))
    search = {**AUDIT, "name": "audit_search", "tool": "search_audit"}
    edit("ticket.create", [{"name": "audit", **AUDIT}, search], {"rule": "quorum", "quorum": 2})
    spec = yaml.safe_load((directory / "service.restart.yaml").read_text())
    monitoring = spec["verification"]["sources"][0]
    billing = {"name": "billing", "server": "billing", "tool": "invoices", "arguments": {"service": "target.id"},
               "expected": ["after.found"]}
    edit("service.restart", [monitoring, billing], {"rule": "primary", "confirm": ["monitoring"],
                                                     "required_confidence": 0.9})
    return directory


@pytest.fixture(scope="module")
def policies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("evidence-policies")
    s = build_stack("stdio", tmp, extra_env={"PROOFLINE_CONTRACTS_DIR": str(own_contracts(tmp / "contracts"))})
    try:
        start_workers(s)
        yield s
    finally:
        teardown_stack(s)


def test_a_quorum_is_met_with_one_source_missing(policies: Stack) -> None:
    """Two of three confirm (the record and the balance, both of the system of record): verified,
    the audit log's dissent recorded. A quorum of views of one system can be fooled together."""
    env = refund_env(policies, new_account(policies))
    row = under_fault(policies, "issue_refund", "lie_consistently", env)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
    found = readings(policies, env.action_id)
    assert {k: v["finding"] for k, v in found.items()} == {"primary": "expected", "balance": "expected",
                                                          "audit": "absent"}, found
    assert found["balance"]["server"] == "sor" and found["audit"]["server"] == "audit"
    [finished] = evidence_of(policies, env.action_id, "verification_finished")
    assert (finished["evidence"]["met"], finished["evidence"]["denying"], finished["evidence"]["quorum"]) == (
        True, ["audit"], 2)


def test_a_quorum_missed_is_a_conflict(policies: Stack) -> None:
    env = ticket_env(policies)
    found = conflicted(policies, "create_ticket", env)
    assert {k: v["finding"] for k, v in found.items()} == {"primary": "expected", "audit": "absent",
                                                          "audit_search": "absent"}
    [finished] = evidence_of(policies, env.action_id, "verification_finished")
    assert finished["evidence"]["met"] is False and finished["evidence"]["confirming"] == ["primary"]
    assert compensations(policies, env.action_id) == 0


def test_a_quorum_met_by_every_source(policies: Stack) -> None:
    env = ticket_env(policies)
    policies.publish(env)
    row = policies.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
    assert {r["finding"] for r in readings(policies, env.action_id).values()} == {"expected"}


def test_confidence_too_low_is_not_verified(policies: Stack) -> None:
    """The record and the monitoring view confirm the restart, the billing source cannot be read:
    2 of 3 is under the required 0.9, and silence is no conflict: unverified, escalated."""
    env = restart_env(policies)
    policies.publish(env)
    row = policies.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome, row.finding, row.reason_code) == (
        ActionStatus.escalated, Outcome.completed_unverified, "unavailable", "verification_unavailable")
    found = readings(policies, env.action_id)
    assert (found["primary"]["finding"], found["monitoring"]["finding"]) == ("expected", "expected")
    assert found["billing"]["finding"] == "unavailable" and "billing" in found["billing"]["last_error"]
    [finished] = evidence_of(policies, env.action_id, "verification_finished")
    assert finished["evidence"]["confidence"] == pytest.approx(2 / 3, abs=1e-3)
    assert finished["evidence"]["required_confidence"] == 0.9


def test_an_unknown_outcome_is_reconciled_by_the_audit_search_while_the_record_cannot_be_read(
        policies: Stack) -> None:
    """The refund is applied but its answer is lost (unknown outcome), and the system of record's
    read path is down: the authoritative read cannot say. The audit search saw the refund: the
    outcome is settled as happened (completed_unverified, still for an operator) and the
    idempotency record completed, so nothing may call again."""
    env = refund_env(policies, new_account(policies), timeout_seconds=1.0)
    sor.set_read_outage(policies.sor_db, True, role="reader")
    sor.set_fault(policies.sor_db, "issue_refund", "drop_response", remaining=1, delay_seconds=5)
    try:
        policies.publish(env)
        row = policies.wait_settled(env.action_id, timeout=90)
    finally:
        sor.set_read_outage(policies.sor_db, False, role="reader")
        sor.clear_faults(policies.sor_db, "issue_refund")
    assert [c["outcome"] for c in evidence_of(policies, env.action_id, "tool_called")] == ["unknown_outcome"]
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.escalated, Outcome.completed_unverified,
                                                          "verification_unavailable")
    found = readings(policies, env.action_id)
    assert found["primary"]["finding"] == "unavailable"
    assert (found["audit_search"]["finding"], found["audit_search"]["server"]) == ("expected", "audit")
    [finished] = evidence_of(policies, env.action_id, "verification_finished")
    assert finished["reconciled"] == {"source": "audit_search", "happened": True}
    with policies.conn.cursor() as cur:
        cur.execute("SELECT status::text AS status FROM idempotency_records WHERE key = %s", (env.idempotency_key,))
        assert cur.fetchone()["status"] == "completed"
    assert policies.effects(env.idempotency_key) == 1
