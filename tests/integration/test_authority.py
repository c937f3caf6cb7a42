"""Authority through the product: a signed policy per action type, approvals signed by approvers,
proposals approved by an exact plan, and every bad approval refused with its reason before any call.

One stack (real Postgres, Redis, a Celery worker, the system-of-record MCP server over stdio behind
a witness relay) runs under a signed authority policy that each test rewrites; the workers reload
it when the file changes. Effects are counted by the system of record and by the witness relay
that sees every ``tools/call`` the workers send."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.approvals import ApprovalScope, sign_approval, statement_for
from proofline.authority import AuthorityPolicy, sign_policy
from proofline.canonical import canonical_bytes
from proofline.keys import KeyRole, SigningKey, add_approver, load_signing_key
from proofline.settings import ROOT, Settings
from proofline.signing import encode_signature
from proofline_kit.sor import store as sor
from recovery import proposals
from tests.conftest import Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import evidence_of, new_account, refund_env, run_of, stale_close_env, ticket_env, uid
from tests.integration.cli_run import as_json, assert_error, proofline
from worker.dispatch import CeleryDispatch

LOOKUP = """
action_type: ticket.lookup
version: 1
server: sor
tool: get_ticket
operation: read
target_type: ticket
result: {mode: structured}
timeout_seconds: 5
precondition_read: {tool: get_ticket, arguments: {ticket_id: "target.id"}}
preconditions:
  - {name: target_exists, expr: "before.found", reason: target_missing}
verification:
  max_duration_seconds: 5
  poll_interval_seconds: 0.2
  expected: ["after.found && after.ticket.id == target.id"]
"""


@dataclass
class Authority:
    stack: Stack
    settings: Settings
    policy_file: Path
    alice: SigningKey
    bob: SigningKey
    version: int = 0

    def policy(self, default: str = "approved", promotion: dict | None = None, **types: dict) -> None:
        """Sign and install a policy (the workers reload it on the next action)."""
        self.version += 1
        policy = AuthorityPolicy.model_validate({"version": self.version, "default_mode": default,
                                                 "action_types": types, "promotion": promotion or {}})
        tmp = self.policy_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(sign_policy(policy, self.alice)))
        tmp.replace(self.policy_file)

    def approve(self, action_id: str, key: SigningKey, **kw) -> dict:
        return proposals.approve(self.settings, self.stack.operator, CeleryDispatch(self.stack.app), action_id, key,
                                 **kw)


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Authority]:
    tmp = tmp_path_factory.mktemp("authority")
    contracts = tmp / "contracts"
    shutil.copytree(ROOT / "contracts", contracts)
    (contracts / "ticket.lookup.yaml").write_text(LOOKUP)
    # Its own action type for the promotion tests, so that no other test's actions count as evidence.
    (contracts / "ticket.open.yaml").write_text((ROOT / "contracts" / "ticket.create.yaml").read_text().replace(
        "action_type: ticket.create", "action_type: ticket.open"))
    # A point of no return the envelope never flags: the contract alone says so.
    purge = (ROOT / "contracts" / "ticket.close.yaml").read_text().replace("action_type: ticket.close",
                                                                          "action_type: ticket.purge")
    (contracts / "ticket.purge.yaml").write_text(purge.replace("point_of_no_return: false", "point_of_no_return: true"))
    policy_file = tmp / "authority.json"
    stack = build_stack("stdio", tmp / "stack", extra_env={"PROOFLINE_AUTHORITY_FILE": str(policy_file),
                                                          "PROOFLINE_CONTRACTS_DIR": str(contracts),
                                                          # a proposal nobody decides expires in seconds
                                                          "PROOFLINE_DEADLINE_GRACE_SECONDS": "1"})
    try:
        ring = stack.settings.keyring_file
        keys = {}
        for name in ("alice", "bob"):
            add_approver(ring, tmp / f"{name}.key", f"{name}@example.com", development=True)
            keys[name] = load_signing_key(tmp / f"{name}.key", KeyRole.approver)
        settings = stack.settings.model_copy(update={"authority_file": policy_file})
        a = Authority(stack, settings, policy_file, keys["alice"], keys["bob"])
        a.policy()
        start_workers(stack)
        yield a
    finally:
        teardown_stack(stack)


def close_env(stack: Stack, action_type: str = "ticket.close", **kw):
    ticket = sor.put_ticket(stack.sor_db, "acme", f"to close {uid()}", "ops")
    version = sor.get_ticket(stack.sor_db, ticket)["ticket"]["version"]
    return stack.envelope(action_type, arguments={"ticket_id": ticket, "expected_version": version},
                          target={"type": "ticket", "id": ticket, "expected_version": version}, **kw)



def approval(a: Authority, env, key: SigningKey | None = None, **kw) -> dict:
    key = key or a.alice
    identity = "alice@example.com" if key is a.alice else "bob@example.com"
    return sign_approval(statement_for(env, approver=identity, **kw), key)


def with_approvals(stack: Stack, env, *approvals: dict):
    return env.model_copy(update={"approvals": tuple(approvals)})


def wait_status(stack: Stack, action_id: str, status: ActionStatus, timeout: float = 120.0):
    return wait_for(lambda: (row := stack.action(action_id)) is not None and row.status == status and row, timeout,
                    what=f"{action_id} to be {status.value} (now {stack.action(action_id)})")


def proposed_close(a: Authority):
    """A ticket.close under mode propose, published and waiting for an approver."""
    a.policy(**{"ticket.close": {"mode": "propose"}})
    env = close_env(a.stack)
    a.stack.publish(env)
    wait_status(a.stack, env.action_id, ActionStatus.proposed)
    return env


def refused_with(a: Authority, env, code: str) -> None:
    """Published, refused at revalidation with ``code``: closed, not started, no tool call sent."""
    a.stack.publish(env)
    row = a.stack.wait_settled(env.action_id)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.not_started, code), row
    assert a.stack.witness.count(key=env.idempotency_key) == 0
    assert a.stack.effects(env.idempotency_key) == 0


# --- modes -----------------------------------------------------------------------------------------


def test_read_mode_refuses_a_write_and_runs_a_read_only_tool(auth: Authority) -> None:
    auth.policy(**{"ticket.create": {"mode": "read"}, "ticket.lookup": {"mode": "read"}})
    refused_with(auth, ticket_env(auth.stack), "authority_mode_refused")
    ticket = sor.put_ticket(auth.stack.sor_db, "acme", "look", "ops")
    lookup = auth.stack.envelope("ticket.lookup", arguments={"ticket_id": ticket},
                                 target={"type": "ticket", "id": ticket})
    auth.stack.publish(lookup)
    row = auth.stack.wait_settled(lookup.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    authority = evidence_of(auth.stack, lookup.action_id, "revalidated")[0]["authority"]
    assert authority["mode"] == "read" and authority["read_only_tool"] == "get_ticket"


def test_simulate_records_a_plan_and_calls_nothing_that_writes(auth: Authority) -> None:
    auth.policy(**{"ticket.close": {"mode": "simulate"}})
    env = close_env(auth.stack)
    auth.stack.publish(env)
    row = auth.stack.wait_settled(env.action_id)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.not_started, "simulated")
    plan = evidence_of(auth.stack, env.action_id, "simulated")[0]
    assert len(plan["plan_hash"]) == 64 and plan["source"] == "prepare_tool"
    assert plan["content"]["tool"] == "close_ticket" and plan["content"]["applicable"] is True
    assert auth.stack.witness.count(key=env.idempotency_key) == 0
    assert sor.get_ticket(auth.stack.sor_db, env.target.id)["ticket"]["status"] == "open"


def test_a_proposal_waits_and_runs_the_approved_plan_once(auth: Authority) -> None:
    env = proposed_close(auth)
    proposed = evidence_of(auth.stack, env.action_id, "proposed")[0]
    assert proposed["mode"] == "propose" and auth.stack.witness.count(key=env.idempotency_key) == 0
    listed = [p["action_id"] for p in proposals.list_proposals(auth.stack.operator)]
    assert env.action_id in listed
    result = auth.approve(env.action_id, auth.alice)
    assert result["released"] and result["plan_hash"] == proposed["plan_hash"]
    row = auth.stack.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row
    assert auth.stack.witness.count(key=env.idempotency_key) == 1
    approvals = evidence_of(auth.stack, env.action_id, "revalidated")[-1]["authority"]["approvals"]
    assert approvals["approvers"] == ["alice@example.com"]
    assert evidence_of(auth.stack, env.action_id, "plan_confirmed")[0]["plan_hash"] == proposed["plan_hash"]
    # The commit carries the approved plan to the server.
    [call] = auth.stack.witness.calls(key=env.idempotency_key)
    assert call.plan_hash == proposed["plan_hash"]


def test_a_plan_changed_after_approval_is_refused_with_no_effect(auth: Authority) -> None:
    env = proposed_close(auth)
    # The ticket changes behind the approver's back: the plan it would now run is not the one approved.
    sor.bump_version(auth.stack.sor_db, "ticket", env.target.id)
    auth.approve(env.action_id, auth.alice)
    row = auth.stack.wait_settled(env.action_id)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.not_started, "plan_changed")
    assert auth.stack.witness.count(key=env.idempotency_key) == 0
    assert sor.get_ticket(auth.stack.sor_db, env.target.id)["ticket"]["status"] == "open"


def test_a_denied_proposal_closes_not_started(auth: Authority) -> None:
    env = proposed_close(auth)
    proposals.deny(auth.stack.operator, env.action_id, "bob@example.com", "not during the freeze")
    row = auth.stack.action(env.action_id)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.not_started, "proposal_denied")
    assert evidence_of(auth.stack, env.action_id, "proposal_denied")[0]["by"] == "bob@example.com"


def test_autonomy_inside_its_bounds_runs_and_outside_becomes_a_proposal(auth: Authority) -> None:
    auth.policy(**{"ticket.create": {"mode": "autonomous", "bounds": {
        "conditions": ["args.owner == 'ops'"], "max_actions_per_tenant": 1000}}})
    inside = ticket_env(auth.stack)
    auth.stack.publish(inside)
    row = auth.stack.wait_settled(inside.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert evidence_of(auth.stack, inside.action_id, "revalidated")[0]["authority"]["mode"] == "autonomous"
    outside = auth.stack.envelope("ticket.create", arguments={"tenant": "acme", "title": f"t-{uid()}", "owner": "cfo"},
                                  target={"type": "ticket_queue", "id": "acme-ops"})
    auth.stack.publish(outside)
    wait_status(auth.stack, outside.action_id, ActionStatus.proposed)
    assert "bounds.conditions.0" in evidence_of(auth.stack, outside.action_id, "proposed")[0]["outside_bounds"]
    assert auth.stack.witness.count(key=outside.idempotency_key) == 0


# --- approvals (mode approved) ----------------------------------------------------------------------


def test_an_approval_signed_by_an_approver_runs_the_action(auth: Authority) -> None:
    auth.policy()
    env = close_env(auth.stack)
    env = with_approvals(auth.stack, env, approval(auth, env))
    auth.stack.publish(env)
    row = auth.stack.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert evidence_of(auth.stack, env.action_id, "revalidated")[0]["authority"]["approvals"]["approvers"] == [
        "alice@example.com"]


def test_no_approval_is_refused(auth: Authority) -> None:
    auth.policy()
    refused_with(auth, close_env(auth.stack), "approval_missing")


@pytest.mark.parametrize("role", ["controller", "worker", "recovery"])
def test_an_approval_signed_by_a_key_that_may_not_approve_is_refused(auth: Authority, role: str) -> None:
    auth.policy()
    env = close_env(auth.stack)
    key = load_signing_key(auth.settings.keys_dir / f"{role}.key", KeyRole(role))
    doc = statement_for(env, approver="alice@example.com").model_dump(mode="json")
    forged = {"approval": doc, "key_id": key.key_id, "signature": encode_signature(key.sign(canonical_bytes(doc)))}
    refused_with(auth, with_approvals(auth.stack, env, forged), "approval_wrong_role")


@pytest.mark.parametrize("change", ["arguments", "target", "plan"])
def test_an_approval_of_another_intent_is_refused(auth: Authority, change: str) -> None:
    auth.policy()
    env = close_env(auth.stack)
    if change == "arguments":
        other = env.model_copy(update={"arguments_hash": "0" * 64})
        refused_with(auth, with_approvals(auth.stack, env, approval(auth, other)), "approval_mismatch")
    elif change == "target":
        other = env.model_copy(update={"target": env.target.model_copy(update={"id": "T-other"})})
        refused_with(auth, with_approvals(auth.stack, env, approval(auth, other)), "approval_mismatch")
    else:
        refused_with(auth, with_approvals(auth.stack, env, approval(auth, env, plan_hash="1" * 64)), "plan_changed")


def test_an_expired_approval_is_refused(auth: Authority) -> None:
    auth.policy()
    env = close_env(auth.stack)
    refused_with(auth, with_approvals(auth.stack, env, approval(auth, env, ttl=timedelta(seconds=-1))),
                 "approval_expired")


def test_a_revoked_approval_stops_an_action_not_yet_sent(auth: Authority) -> None:
    auth.policy()
    env = close_env(auth.stack)
    apv = approval(auth, env)
    assert proposals.revoke_approval(auth.stack.operator, apv["approval"]["approval_id"], "bob@example.com",
                                     "approved by mistake")
    refused_with(auth, with_approvals(auth.stack, env, apv), "approval_revoked")
    assert [e["event"] for e in auth.stack.timeline(f"approval:{apv['approval']['approval_id']}")] == ["approval_revoked"]


def test_a_point_of_no_return_from_the_contract_needs_an_approval_that_covers_it(auth: Authority) -> None:
    auth.policy(**{"ticket.purge": {"mode": "approved", "approvers_required": 2}})
    env = close_env(auth.stack, "ticket.purge")
    assert env.irreversible is False  # only the contract says it cannot be undone
    refused_with(auth, with_approvals(auth.stack, env, approval(auth, env), approval(auth, env, auth.bob)),
                 "approval_scope_exceeded")


def test_two_approvers_where_two_are_required(auth: Authority) -> None:
    auth.policy(**{"ticket.purge": {"mode": "approved", "approvers_required": 2}})
    covering = ApprovalScope(covers_irreversible=True)
    one = close_env(auth.stack, "ticket.purge")
    # The same approver twice counts once.
    refused_with(auth, with_approvals(auth.stack, one, approval(auth, one, scope=covering),
                                      approval(auth, one, scope=covering)), "approvers_insufficient")
    two = close_env(auth.stack, "ticket.purge")
    auth.stack.publish(with_approvals(auth.stack, two, approval(auth, two, scope=covering),
                                      approval(auth, two, auth.bob, scope=covering)))
    row = auth.stack.wait_settled(two.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row
    revalidated = evidence_of(auth.stack, two.action_id, "revalidated")[0]
    assert revalidated["authority"]["approvals"]["approvers"] == ["alice@example.com", "bob@example.com"]
    assert revalidated["authority"]["point_of_no_return"] == {"declared_by": "contract", "compensation": "not available"}


# --- evidence-gated promotion and automatic demotion ------------------------------------------------


def open_env(stack: Stack, owner: str = "ops"):
    return stack.envelope("ticket.open", arguments={"tenant": "acme", "title": f"t-{uid()}", "owner": owner},
                          target={"type": "ticket_queue", "id": "acme-ops"})


def test_promotion_is_refused_without_evidence_and_granted_with_it(auth: Authority) -> None:
    bounds = {"bounds": {"conditions": ["args.owner == 'ops'"]}}
    auth.policy(promotion={"min_verified": 2, "window_days": 1}, **{"ticket.open": {"mode": "propose", **bounds}})
    key = ["--key", str(auth.stack.workdir.parent / "alice.key")]
    refused = proofline(auth.stack, "authority", "promote", "ticket.open", "--to", "autonomous", *key)
    assert_error(refused, 16, "promotion_refused", "no action ran in this mode")
    for _ in range(2):  # the evidence: two proposals approved, run and verified
        env = open_env(auth.stack)
        auth.stack.publish(env)
        wait_status(auth.stack, env.action_id, ActionStatus.proposed)
        auth.approve(env.action_id, auth.bob)
        assert auth.stack.wait_settled(env.action_id).outcome == Outcome.completed_verified
    status = as_json(proofline(auth.stack, "--json", "authority", "status", "ticket.open"))
    [row] = [r for r in status["evidence"] if r["mode"] == "propose"]
    assert (row["actions"], row["verified"], row["unresolved"], row["promotion_lacks"]) == (2, 2, 0, [])
    granted = as_json(proofline(auth.stack, "--json", "authority", "promote", "ticket.open", "--to", "autonomous",
                                *key))
    assert (granted["from"], granted["to"], granted["evidence"]["verified"]) == ("propose", "autonomous", 2)
    [promoted] = [e["evidence"] for e in auth.stack.timeline("authority:ticket.open") if e["event"] == "authority_promoted"]
    assert promoted["previous_policy_hash"] != promoted["policy_hash"]
    auth.version = granted["policy_version"]
    # The workers now run it without a human, inside its bounds.
    env = open_env(auth.stack)
    auth.stack.publish(env)
    assert auth.stack.wait_settled(env.action_id).outcome == Outcome.completed_verified
    assert evidence_of(auth.stack, env.action_id, "revalidated")[0]["authority"]["mode"] == "autonomous"


def test_an_unresolved_outcome_demotes_autonomy_to_proposals(auth: Authority) -> None:
    auth.policy(**{"ticket.open": {"mode": "autonomous", "bounds": {"max_actions_per_tenant": 10_000}}})
    env = open_env(auth.stack)
    # The answer is lost (an unknown outcome) and the read path is down: nothing can settle it.
    sor.set_fault(auth.stack.sor_db, "create_ticket", "drop_response", remaining=1, delay_seconds=20)
    sor.set_read_outage(auth.stack.sor_db, True, role="reader")
    try:
        auth.stack.publish(env)
        row = auth.stack.wait_settled(env.action_id, timeout=90)
    finally:
        sor.set_read_outage(auth.stack.sor_db, False, role="reader")
        sor.clear_faults(auth.stack.sor_db, "create_ticket")
    assert (row.status, row.outcome) == (ActionStatus.escalated, Outcome.unknown_outcome), row
    # The reconciler's sweep (every second in the test stack) demotes the type under this policy.
    demoted = wait_for(lambda: [e["evidence"] for e in auth.stack.timeline("authority:ticket.open")
                                if e["event"] == "authority_demoted"], 30, what="a demotion of ticket.open")
    assert demoted[-1]["to"] == "propose" and demoted[-1]["regressions"][0]["action_id"] == env.action_id
    after = open_env(auth.stack)
    auth.stack.publish(after)
    wait_status(auth.stack, after.action_id, ActionStatus.proposed)
    assert evidence_of(auth.stack, after.action_id, "proposed")[0]["demoted"].startswith("1 open regression")
    assert auth.stack.witness.count(key=after.idempotency_key) == 0


def test_the_cli_approves_and_denies_proposals(auth: Authority) -> None:
    env = proposed_close(auth)
    listed = as_json(proofline(auth.stack, "--json", "proposals", "list"))["proposals"]
    assert env.action_id in [p["action_id"] for p in listed]
    key = str(auth.stack.workdir.parent / "bob.key")
    approved = as_json(proofline(auth.stack, "--json", "approve", env.action_id, "--key", key, "--note", "checked"))
    assert approved["released"] and approved["approver"] == "bob@example.com"
    assert auth.stack.wait_settled(env.action_id).outcome == Outcome.completed_verified
    again = proofline(auth.stack, "approve", env.action_id, "--key", key)
    assert_error(again, 16, "proposal_refused", "not proposed")
    other = proposed_close(auth)
    denied = as_json(proofline(auth.stack, "--json", "deny", other.action_id, "--reason", "freeze", "--by", "bob"))
    assert denied["denied"] and auth.stack.action(other.action_id).reason_code == "proposal_denied"


def test_a_compensation_of_money_is_proposed_and_runs_once_approved(auth: Authority) -> None:
    # Both tools are destructive (their servers say so): autonomy needs the policy's reason for each.
    auth.policy(**{"refund.issue": {"mode": "autonomous", "bounds": {"max_amount_cents": 100_000},
                                    "autonomous_reason": "small refunds are reconciled daily"},
                   "ticket.close": {"mode": "autonomous", "bounds": {},
                                    "autonomous_reason": "closing a ticket is reviewed after the fact"}})
    account = new_account(auth.stack)
    steps = run_of(auth.stack, [lambda **kw: refund_env(auth.stack, account, **kw),
                                lambda **kw: stale_close_env(auth.stack, **kw)])
    auth.stack.publish_run(steps)
    # The second step cannot start, so the run unwinds the refund: recovery derives its reversal,
    # and the policy's default for a type that moves money is to propose it to an approver.
    reversal = wait_for(lambda: next((e["evidence"]["recovery_action"] for e in auth.stack.timeline(steps[0].action_id)
                                      if e["event"] == "recovery_action_published"), None), 60,
                        what="the refund's reversal")
    wait_status(auth.stack, reversal, ActionStatus.proposed)
    proposed = evidence_of(auth.stack, reversal, "proposed")[0]
    assert (proposed["recovery"], proposed["parent_action_type"]) == ("proposed", "refund.issue")
    assert sor.get_account(auth.stack.sor_db, account)["account"]["balance_cents"] == 100_000 - 1200
    auth.approve(reversal, auth.alice)
    assert auth.stack.wait_settled(reversal).outcome == Outcome.completed_verified
    assert wait_for(lambda: auth.stack.action(steps[0].action_id).outcome == Outcome.compensated, 60,
                    what="the refund compensated")
    assert sor.get_account(auth.stack.sor_db, account)["account"]["balance_cents"] == 100_000
    reversal_row = auth.stack.action(reversal)
    assert auth.stack.witness.count(key=reversal_row.idempotency_key) == 1


def test_a_revoked_approval_of_a_proposal_no_longer_counts(auth: Authority) -> None:
    auth.policy(**{"ticket.close": {"mode": "propose", "approvers_required": 2}})
    env = close_env(auth.stack)
    auth.stack.publish(env)
    wait_status(auth.stack, env.action_id, ActionStatus.proposed)
    first = auth.approve(env.action_id, auth.alice)
    assert not first["released"] and first["required"] == 2
    assert proposals.revoke_approval(auth.stack.operator, first["approval_id"], "alice@example.com", "looked again")
    second = auth.approve(env.action_id, auth.bob)
    assert not second["released"] and second["approvers"] == ["bob@example.com"]
    [listed] = [p for p in proposals.list_proposals(auth.stack.operator) if p["action_id"] == env.action_id]
    assert listed["approvals"] == 1
    third = auth.approve(env.action_id, auth.alice)  # alice's revoked approval is no approval: she may sign anew
    assert third["released"] and third["approvers"] == ["alice@example.com", "bob@example.com"]
    row = auth.stack.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row
    authority = evidence_of(auth.stack, env.action_id, "revalidated")[-1]["authority"]
    assert authority["revoked_approvals_ignored"] == [first["approval_id"]]
    assert authority["approvals"]["approvers"] == ["alice@example.com", "bob@example.com"]


def test_every_change_of_policy_is_ledgered(auth: Authority) -> None:
    auth.policy(**{"ticket.close": {"mode": "simulate"}})
    signed = json.loads(auth.policy_file.read_text())
    from proofline.canonical import sha256_hex

    digest = sha256_hex(signed["policy"])

    def recorded() -> list[dict]:
        return [e["evidence"] for e in auth.stack.timeline("authority:policy") if e["event"] == "authority_policy_changed"]

    # The reconciler's sweep (every second in the test stack) notices the new file.
    changes = wait_for(lambda: [c for c in recorded() if c["policy_hash"] == digest], 30, what="the policy change")
    assert changes[-1]["version"] == auth.version and changes[-1]["signed_by"] == "alice@example.com"
    assert changes[-1]["previous_policy_hash"] not in (None, digest)


def test_the_sdk_approver_signs_approves_and_revokes(auth: Authority) -> None:
    from proofline.approver import Approver

    with Approver(auth.stack.workdir.parent / "bob.key", auth.settings, app=auth.stack.app,
                  database_url=auth.stack.urls["operator"]) as bob:
        auth.policy()
        carried = close_env(auth.stack)
        carried = with_approvals(auth.stack, carried, bob.sign(carried))
        auth.stack.publish(carried)
        assert auth.stack.wait_settled(carried.action_id).outcome == Outcome.completed_verified
        env = proposed_close(auth)
        assert env.action_id in [p["action_id"] for p in bob.proposals()]
        assert bob.proposal(env.action_id)["plan"]["plan_hash"]
        assert bob.approve(env.action_id, note="sdk")["released"]
        assert auth.stack.wait_settled(env.action_id).outcome == Outcome.completed_verified
        withdrawn = close_env(auth.stack)
        apv = bob.sign(withdrawn)
        assert bob.revoke(apv["approval"]["approval_id"], "sent to the wrong team")
        assert apv["approval"]["approval_id"] in [r["approval_id"] for r in bob.revoked()]
        auth.policy()
        refused_with(auth, with_approvals(auth.stack, withdrawn, apv), "approval_revoked")
        rows = bob.status("ticket.close")
        assert any(r["mode"] == "propose" and r["verified"] >= 1 for r in rows)


def test_a_proposal_nobody_decides_expires_with_its_deadline(auth: Authority) -> None:
    auth.policy(**{"ticket.close": {"mode": "propose"}})
    env = close_env(auth.stack, deadline_in=timedelta(seconds=6))
    auth.stack.publish(env)
    wait_status(auth.stack, env.action_id, ActionStatus.proposed)
    row = auth.stack.wait_settled(env.action_id, timeout=40)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.not_started,
                                                          "deadline_expired_unexecuted")
    assert auth.stack.witness.count(key=env.idempotency_key) == 0


def test_an_approval_whose_statement_was_edited_after_signing_is_refused(auth: Authority) -> None:
    """The approver signed another intent; the statement is swapped for this action's intent and the
    signature kept. Everything the statement says matches: only the signature check stands."""
    auth.policy()
    env = close_env(auth.stack)
    other = env.model_copy(update={"arguments_hash": "0" * 64})
    signed = approval(auth, other)
    edited = {**signed, "approval": statement_for(env, approver="alice@example.com").model_dump(mode="json")}
    refused_with(auth, with_approvals(auth.stack, env, edited), "approval_signature_invalid")
