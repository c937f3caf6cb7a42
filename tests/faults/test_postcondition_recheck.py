"""Post-condition re-checks through the product: real workers and beat, the system-of-record MCP
server over stdio, Postgres, under a signed authority policy.

- A ticket created autonomously is re-checked twice. The first re-check holds; the workers (and
  beat with them) are stopped and started again; the ticket is then closed behind the runtime's
  back; the second re-check, scheduled in Postgres and claimed by the restarted reconciler, finds
  the regression: ``postcondition_regressed``, signed, the action handed to recovery (which accepts
  the signed evidence and decides), the regression counter the alert reads raised, and the type
  demoted to proposals as its policy says.
- A chain whose re-checks all hold ends at its horizon: every row held, nothing left open.
- A re-check whose worker died (its claim left open) is claimed again once the claim expires.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ledger import store
from ledger.states import ActionStatus, Outcome
from proofline.authority import AuthorityPolicy, sign_policy
from proofline.keys import KeyRole, add_approver, load_signing_key
from proofline.settings import ROOT
from proofline.telemetry.ledger_metrics import LedgerCollector
from proofline_kit.processes import stop_process
from proofline_kit.sor import store as sor
from tests.conftest import Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import evidence_of, uid

#: The second re-check leaves the restart time to finish before it is due (a slow machine included).
REGRESSING = {"at": ["2s", "25s"], "horizon": "2m"}
HOLDING = {"at": ["1s", "2s"], "horizon": "12s"}


def _contracts(directory: Path) -> Path:
    shutil.copytree(ROOT / "contracts", directory)
    base = yaml.safe_load((ROOT / "contracts" / "ticket.create.yaml").read_text())
    for name, recheck in (("ticket.create", REGRESSING), ("ticket.note", HOLDING)):
        spec = {**base, "action_type": name}
        # A ticket the agent opened must stay open: closed behind its back is a prohibited change.
        spec["verification"] = {**base["verification"], "recheck": recheck,
                                "prohibited": [*base["verification"]["prohibited"],
                                               "after.found && after.ticket.status == 'closed'"]}
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return directory


@pytest.fixture(scope="module")
def rechecks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("rechecks")
    policy_file = tmp / "authority.json"
    stack = build_stack("stdio", tmp / "stack", extra_env={"PROOFLINE_AUTHORITY_FILE": str(policy_file),
                                                          "PROOFLINE_CONTRACTS_DIR": str(_contracts(tmp / "c")),
                                                          "PROOFLINE_RECHECK_CLAIM_SECONDS": "20"})
    try:
        add_approver(stack.settings.keyring_file, tmp / "alice.key", "alice@example.com", development=True)
        alice = load_signing_key(tmp / "alice.key", KeyRole.approver)
        bounded = {"mode": "autonomous", "bounds": {"max_actions_per_tenant": 10_000}}
        policy = AuthorityPolicy.model_validate({"version": 1, "default_mode": "approved", "action_types": {
            "ticket.create": bounded, "ticket.note": bounded, "ticket.close": bounded}})
        policy_file.write_text(json.dumps(sign_policy(policy, alice)))
        start_workers(stack)
        yield stack
    finally:
        teardown_stack(stack)


def create(stack: Stack, action_type: str):
    env = stack.envelope(action_type, arguments={"tenant": "acme", "title": f"t-{uid()}", "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"})
    stack.publish(env)
    row = stack.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
    return env


def checks(stack: Stack, action_id: str) -> list[dict]:
    with store.connect(stack.admin_url) as conn:
        return [dict(r) for r in conn.execute("SELECT seq, status, attempts, finding FROM postcondition_checks "
                                              "WHERE action_id = %s ORDER BY seq", (action_id,)).fetchall()]


def events_named(stack: Stack, action_id: str, name: str) -> list[dict]:
    return evidence_of(stack, action_id, name)


def regressions_counted(stack: Stack) -> float:
    """``proofline_ledger_postcondition_regressions_total`` as the exporter serves it."""
    collector = LedgerCollector(stack.urls["reader"])
    total = 0.0
    for family in collector.collect():
        if family.name == "proofline_ledger_postcondition_regressions":
            total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def restart_workers(stack: Stack) -> None:
    """Stop every worker process (beat with the first) and start them again."""
    for proc in list(stack.workers):
        stop_process(proc)
        stack.workers.remove(proc)
    start_workers(stack)


def test_a_held_chain_ends_at_its_horizon(rechecks: Stack) -> None:
    stack = rechecks
    env = create(stack, "ticket.note")
    wait_for(lambda: [c["status"] for c in checks(stack, env.action_id)] == ["held", "held"], 40,
             what="both re-checks to hold")
    held = events_named(stack, env.action_id, "postcondition_held")
    # Each read on its own (in the order the workers finished them); the one finished last ends the chain.
    assert sorted(h["recheck"] for h in held) == [1, 2]
    assert [h["chain_ended"] for h in held] == [False, True]
    # Past the horizon, sweeps go on and find nothing more to do for it.
    with store.connect(stack.admin_url) as conn:
        wait_for(lambda: conn.execute("SELECT count(*) AS n FROM sweep_runs WHERE started_at > "
                                      "(SELECT max(horizon_at) FROM postcondition_checks WHERE action_id = %s)",
                                      (env.action_id,)).fetchone()["n"] >= 2, 30, what="two sweeps past the horizon")
    assert [c["status"] for c in checks(stack, env.action_id)] == ["held", "held"]
    names = stack.events(env.action_id)
    assert names.count("recheck_claimed") == 2 and "recheck_expired" not in names
    row = stack.action(env.action_id)
    assert row is not None and (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)


def test_a_re_check_whose_worker_died_is_claimed_again(rechecks: Stack) -> None:
    """A claim sent to a worker that died is left open; once it expires the reconciler
    claims it again, under a new attempt, and a worker reads it."""
    stack = rechecks
    env = create(stack, "ticket.note")
    with store.connect(stack.admin_url) as conn, conn.transaction():
        # As if the reconciler had claimed both and the worker holding them had died.
        abandoned = [r["seq"] for r in conn.execute(
            "UPDATE postcondition_checks SET status = 'claimed', attempts = 1, claim_expires_at = "
            "clock_timestamp() + interval '2 seconds' WHERE action_id = %s AND status = 'scheduled' RETURNING seq",
            (env.action_id,)).fetchall()]
    assert abandoned, "both re-checks were claimed before the test could abandon one"
    wait_for(lambda: [c["status"] for c in checks(stack, env.action_id)] == ["held", "held"], 40,
             what="the abandoned re-checks to be claimed again and read")
    attempts = {c["seq"]: c["attempts"] for c in checks(stack, env.action_id)}
    assert all(attempts[seq] == 2 for seq in abandoned), attempts
    claims = [c for c in events_named(stack, env.action_id, "recheck_claimed") if c["recheck"] in abandoned]
    assert sorted(c["attempt"] for c in claims) == [2] * len(abandoned)


# Last: its recovery contains create_ticket for the tenant (the compensation finds the ticket
# closed already and fails), which would stop the tests above.
def test_a_regression_is_found_at_the_second_re_check_after_a_worker_restart(rechecks: Stack) -> None:
    stack = rechecks
    before = regressions_counted(stack)
    env = create(stack, "ticket.create")
    [scheduled] = events_named(stack, env.action_id, "recheck_scheduled")
    assert (scheduled["checks"], scheduled["at_seconds"], scheduled["horizon_seconds"]) == (2, [2.0, 25.0], 120.0)
    wait_for(lambda: events_named(stack, env.action_id, "postcondition_held"), 40, what="the first re-check to hold")
    [held] = events_named(stack, env.action_id, "postcondition_held")
    assert (held["recheck"], held["finding"], held["identity"], held["chain_ended"]) == (1, "expected", "read", False)
    assert [c["status"] for c in checks(stack, env.action_id)] == ["held", "scheduled"]

    restart_workers(stack)
    # Out of band, after the restart: someone closes the ticket the agent created.
    [finished] = events_named(stack, env.action_id, "verification_finished")
    ticket = finished["after"]["ticket"]
    sor.close_ticket(stack.sor_db, ticket["id"], ticket["version"])
    assert [c["status"] for c in checks(stack, env.action_id)] == ["held", "scheduled"], "re-checked too early"

    wait_for(lambda: events_named(stack, env.action_id, "postcondition_regressed"), 90,
             what="the second re-check to find the regression")
    [regressed] = events_named(stack, env.action_id, "postcondition_regressed")
    assert (regressed["recheck"], regressed["of"], regressed["finding"], regressed["read_finding"]) == (
        2, 2, "prohibited", "prohibited")
    assert regressed["after"]["ticket"]["status"] == "closed"
    assert [c["status"] for c in checks(stack, env.action_id)] == ["held", "regressed"]
    names = stack.events(env.action_id)
    at = names.index("postcondition_regressed")
    assert names[at + 1:at + 3] == ["evidence_signed", "handed_to_recovery"], names
    # Recovery accepted the signed regression and decided on it, as after a failed verification.
    wait_for(lambda: events_named(stack, env.action_id, "recovery_decided"), 60, what="a recovery decision")
    [decided] = events_named(stack, env.action_id, "recovery_decided")
    assert (decided["facts"]["outcome"], decided["facts"]["finding"]) == ("completed_verified", "prohibited")
    assert "recovery_refused" not in stack.events(env.action_id)
    row = stack.action(env.action_id)
    assert row is not None and row.reason_code in ("postcondition_regressed", decided["reason"])
    # What the alert reads, and the demotion the policy asks for (autonomous -> propose).
    assert regressions_counted(stack) == before + 1
    demoted = wait_for(lambda: [e["evidence"] for e in stack.timeline("authority:ticket.create")
                                if e["event"] == "authority_demoted"], 30, what="a demotion of ticket.create")
    assert demoted[-1]["to"] == "propose"
    assert env.action_id in [r["action_id"] for r in demoted[-1]["regressions"]]
