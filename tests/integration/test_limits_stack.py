"""Containment on the real stack (Postgres, Redis, Celery worker processes, the system of record
over stdio): CEL bombs, a broken contract file, a 20 MiB tool result, a 30-day deadline, and
authority budgets per action and per run. Every case ends as a recorded outcome; the pool
processes that met the bombs are the same processes afterwards."""

from __future__ import annotations

import shutil
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.controller import prepare, signed_message
from proofline.errors import ContractInvalid
from proofline_kit import zygote
from proofline_kit.sor import store as sor
from tests.conftest import ROOT, Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import refund_under_fault

TABLES = ("ledger_events", "actions", "idempotency_records")


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (the supervisor's Celery worker and its pool), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def pool_pids(stack: Stack) -> set[int]:
    # Only Celery processes: MCP server children come and go with their sessions.
    pids = set()
    for pid in descendants(stack.workers[0].pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"proofline_kit.sor" in cmdline or b"proofline.cel_watchdog" in cmdline:
            continue  # MCP servers and evaluator helpers come and go with their sessions
        if b"celery" in cmdline or b"proofline" in cmdline:
            pids.add(pid)
    return pids


def ticket(stack: Stack, tenant: str = "acme", **kw):
    return stack.envelope("ticket.create", tenant=tenant,
                          arguments={"tenant": tenant, "title": "disk full", "owner": "ops"},
                          target={"type": "ticket_queue", "id": f"{tenant}-ops"}, **kw)


def refund(stack: Stack, account: str, amount: int, *, version: int | None = None, **kw):
    current = sor.get_account(stack.sor_db, account)["account"]["version"]
    return stack.envelope(
        "refund.issue", arguments={"account": account, "tenant": "acme", "amount_cents": amount, "reason": "outage"},
        target={"type": "account", "id": account, "expected_version": current if version is None else version}, **kw)


def new_account(stack: Stack, balance: int = 10_000_000) -> str:
    name = f"acct-{time.monotonic_ns()}"
    sor.put_account(stack.sor_db, name, "acme", balance)
    return name


def event(stack: Stack, action_id: str, name: str) -> dict:
    return next(e["evidence"] for e in stack.timeline(action_id) if e["event"] == name)


def relation_bytes(stack: Stack) -> int:
    with stack.conn.cursor() as cur:
        cur.execute("SELECT sum(pg_total_relation_size(t::regclass))::bigint AS n FROM unnest(%s::text[]) t",
                    (list(TABLES),))
        return int(cur.fetchone()["n"])


def assert_good_action_still_served(stack: Stack) -> None:
    good = ticket(stack, tenant="globex")
    stack.publish(good)
    row = stack.wait_settled(good.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)


BOMBS = {
    "terms_15000": " + ".join("1" for _ in range(15_000)) + " > 0",
    "nested_map": "size([1,2,3,4,5,6,7,8,9,10].map(a, [1,2,3,4,5,6,7,8,9,10].map(b, "
                  "[1,2,3,4,5,6,7,8,9,10].map(c, [1,2,3,4,5,6,7,8,9,10].map(d, d))))) > 0",
    "parens_120k": "(" * 120_000 + "1" + ")" * 120_000 + " == 1",
}


@pytest.mark.parametrize("where", ["preconditions", "expected_postconditions"])
def test_cel_bombs_are_refused_and_the_pool_survives(stack: Stack, where: str) -> None:
    pools = pool_pids(stack)
    assert len(pools) >= 3  # the Celery main process and its two pool processes
    envelopes = {name: ticket(stack, tenant="acme", **{where: ("true", bomb)}) for name, bomb in BOMBS.items()}
    for env in envelopes.values():
        stack.publish(env)
    for name, env in envelopes.items():
        row = stack.wait_settled(env.action_id)
        assert (row.status, row.outcome, row.reason_code) == \
            (ActionStatus.closed, Outcome.not_started, "condition_too_complex"), name
        assert stack.effects(env.idempotency_key) == 0
        evidence = event(stack, env.action_id, "revalidation_failed")
        assert evidence["reason_code"] == "condition_too_complex"
        assert "tool_called" not in stack.events(env.action_id)
    assert_good_action_still_served(stack)
    assert pool_pids(stack) == pools, "a pool process died and was replaced"
    assert stack.workers_alive()


def test_a_condition_failing_at_evaluation_is_a_recorded_precondition_failure(stack: Stack) -> None:
    pools = pool_pids(stack)
    env = ticket(stack, preconditions=("1 / 0 == 1",))
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "condition_error")
    failures = event(stack, env.action_id, "preconditions_failed")["failures"]
    assert failures == [{"name": "envelope[0]", "expr": "1 / 0 == 1", "reason": "condition_error"}]
    assert stack.effects(env.idempotency_key) == 0
    assert pool_pids(stack) == pools


def test_a_comprehension_over_its_time_budget_is_a_recorded_failure(stack: Stack) -> None:
    """Inside every static limit, yet about 20-35 s of work in process: the watchdog's helper stops
    it at its budget and the action ends not started; the pool process never notices."""
    pools = pool_pids(stack)
    slow = "args.items.exists(i, size(" + " + ".join(["args.s"] * 20) + ") < 0)"
    env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": "t", "owner": "ops",
                                                     "items": list(range(1000)), "s": "x" * (200 * 1024)},
                         target={"type": "ticket_queue", "id": "acme-ops"}, preconditions=(slow,))
    mark = stack.witness.mark()
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "condition_error")
    # Timed from the answer to the precondition read (the witness's clock: the last read the write
    # server answered before the failure) to the recorded failure (the ledger's), so that queueing
    # and a session's start on a loaded machine are not counted.
    failed_at = next(e["at"] for e in stack.timeline(env.action_id) if e["event"] == "preconditions_failed")
    answers = [c.result["at"] for c in stack.witness.calls(server="sor", since=mark)
               if c.result is not None and c.result["at"] <= failed_at.timestamp()]
    assert answers and failed_at.timestamp() - answers[-1] < 15, (answers, failed_at)
    assert stack.effects(env.idempotency_key) == 0
    assert_good_action_still_served(stack)
    assert pool_pids(stack) == pools


def test_results_are_stored_once(stack: Stack) -> None:
    env = ticket(stack)
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert row.outcome == Outcome.completed_verified
    values = row.result["values"]
    assert values["ticket_id"].startswith("T-")
    called = event(stack, env.action_id, "tool_called")
    assert "result" not in called and called["result_digest"] == row.result["result_digest"]
    with stack.conn.cursor() as cur:
        cur.execute("SELECT result FROM idempotency_records WHERE key = %s", (env.idempotency_key,))
        record = cur.fetchone()["result"]
    assert record["result_digest"] == row.result["result_digest"] and "values" not in record


def peak_rss_kib(pids: set[int]) -> dict[int, int]:
    peaks = {}
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        peaks[pid] = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
    return peaks


@pytest.mark.parametrize("mib", [1, 20])
def test_a_huge_result_is_stored_once_as_digest_and_settled_by_verification(stack: Stack, mib: int) -> None:
    """Past the limit nothing of the result is parsed or stored but its size, digest and excerpt.
    1 MiB passes the transport's message bound (4x the result limit) and is refused by the
    classifier; 20 MiB is cut off by the bounded stdio transport while it streams in."""
    pools = pool_pids(stack)
    peaks = peak_rss_kib(pools)
    before = relation_bytes(stack)
    env = ticket(stack)
    sor.set_fault(stack.sor_db, "create_ticket", "huge_result", remaining=1, delay_seconds=mib)
    started = time.monotonic()
    stack.publish(env)
    row = stack.wait_settled(env.action_id, timeout=90)
    elapsed = time.monotonic() - started
    called = event(stack, env.action_id, "tool_called")
    assert (called["outcome"], called["reason_code"]) == ("unknown_outcome", "result_too_large"), called
    assert called["result_size"] > mib * 1024 * 1024
    assert called["result_limit"] == (256 * 1024 if mib == 1 else 4 * 256 * 1024 + 64 * 1024)
    assert called.get("read_by") == (None if mib == 1 else "transport")
    assert len(called["result_excerpt"]) <= 1024 and len(called["result_digest"]) == 64
    assert row.result["result_digest"] == called["result_digest"] and row.result["oversize"] is True
    # Verification read the system of record and settled it: the ticket exists, once.
    assert (row.status, row.outcome, row.finding) == (ActionStatus.closed, Outcome.completed_verified, "expected")
    assert stack.effects(env.idempotency_key) == 1
    assert row.result.get("recovered_by") == "verification"
    grown = relation_bytes(stack) - before
    after = peak_rss_kib(pools)
    rss = max((after[p] - peaks.get(p, after[p]) for p in after), default=0)
    print(f"\n{mib} MiB result ({called['reason_code']}): ledger tables grew {grown} bytes, settled in "
          f"{elapsed:.1f}s, largest pool peak-RSS growth {rss} KiB")
    assert grown < 512 * 1024
    assert pool_pids(stack) == pools
    assert_good_action_still_served(stack)


def test_a_30_day_deadline_is_refused(stack: Stack) -> None:
    env = ticket(stack, deadline_in=timedelta(days=30), approval_ttl=timedelta(days=31))
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.not_started, "deadline_too_far")
    assert stack.effects(env.idempotency_key) == 0


def test_an_amount_over_the_authority_budget_is_refused(stack: Stack) -> None:
    account = new_account(stack)
    env = refund(stack, account, 9_000_000, authority_budget={"max_amount_cents": 100})
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "authority_budget_exceeded")
    assert event(stack, env.action_id, "revalidation_failed")["scope"] == "action"
    assert stack.effects(env.idempotency_key) == 0
    assert sor.get_account(stack.sor_db, account)["account"]["balance_cents"] == 10_000_000


def test_the_authority_budget_holds_across_a_run(stack: Stack) -> None:
    run = f"run-budget-{time.monotonic_ns()}"
    budget = {"max_amount_cents": 2000}
    # Not started (stale version): moved nothing, so it does not count against the run.
    stale = refund(stack, new_account(stack), 1500, version=999, run_id=run, action_id=f"{run}-a",
                   authority_budget=budget)
    stack.publish(stale)
    assert stack.wait_settled(stale.action_id).reason_code == "stale_version"
    paid = refund(stack, new_account(stack), 1500, run_id=run, action_id=f"{run}-b", authority_budget=budget)
    stack.publish(paid)
    assert stack.wait_settled(paid.action_id).outcome == Outcome.completed_verified
    assert event(stack, paid.action_id, "authority_budget_checked")["run_spent_cents"] == 0
    over = refund(stack, new_account(stack), 1000, run_id=run, action_id=f"{run}-c", authority_budget=budget)
    stack.publish(over)
    row = stack.wait_settled(over.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "authority_budget_exceeded")
    refused = event(stack, over.action_id, "revalidation_failed")
    assert (refused["scope"], refused["run_spent_cents"], refused["counted"]) == ("run", "1500", paid.action_id)
    assert stack.effects(over.idempotency_key) == 0


# --- a broken contract file on the workers -------------------------------------------------------


def test_the_call_budget_ends_retries_the_retry_policy_would_still_allow(stack: Stack) -> None:
    """The approval allows one call; the retry policy three. The call fails before any side effect
    every time: the action closes after that one call, as retries exhausted by the budget."""
    env = refund(stack, new_account(stack), 1200, authority_budget={"max_calls": 1},
                 retry_policy={"max_attempts": 3, "backoff_seconds": 0})
    row = refund_under_fault(stack, env, "fail_before_commit", remaining=-1)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.failed_before_side_effect), row.reason_code
    assert event(stack, env.action_id, "retries_exhausted")["attempts"] == 1
    assert "retry_scheduled" not in stack.events(env.action_id)
    assert stack.witness.count(key=env.idempotency_key) == 1
    assert stack.effects(env.idempotency_key) == 0


@pytest.fixture(scope="module")
def broken_stack(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("broken-contracts")
    contracts = tmp / "contracts"
    shutil.copytree(ROOT / "contracts", contracts)
    path = contracts / "ticket.close.yaml"
    path.write_text(path.read_text().replace('expr: "before.found"',
                                             'expr: "' + " + ".join("1" for _ in range(100)) + ' > 0"', 1))
    s = build_stack("stdio", tmp, extra_env={"PROOFLINE_CONTRACTS_DIR": str(contracts)})
    try:
        start_workers(s, name="broken")
        yield s, contracts
    finally:
        teardown_stack(s)


def test_a_broken_contract_refuses_its_action_type_only(broken_stack) -> None:
    stack, contracts = broken_stack
    check = zygote.run([sys.executable, "-m", "proofline", "contracts", "check", "--dir", str(contracts)],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert check.returncode == 1
    assert "refused  ticket.close.yaml (ticket.close)" in check.stderr and "operators" in check.stderr
    assert check.stdout.count("ok ") == 4

    created = sor.create_ticket(stack.sor_db, "acme", "to close", "ops")
    args = {"arguments": {"ticket_id": created["ticket_id"], "expected_version": 1},
            "target": {"type": "ticket", "id": created["ticket_id"], "expected_version": 1}}
    # The controller refuses to prepare an action whose contract file is broken ...
    with pytest.raises(ContractInvalid, match="ticket.close.yaml"):
        stack.envelope("ticket.close", **args)
    # ... and a controller holding an intact copy of the contracts sends one anyway: the workers,
    # reading the broken file, refuse it and record why.
    intact = stack.settings.model_copy(update={"contracts_dir": ROOT / "contracts"})
    uid = uuid.uuid4().hex[:10]
    close = prepare(intact, action_type="ticket.close", tenant="acme", run_id=f"run-{uid}", action_id=f"act-{uid}",
                    live=stack.live(), **args)
    stack.deliver(signed_message(intact, close))
    wait_for(lambda: any(r["evidence"].get("claimed", {}).get("action_id") == close.action_id
                         for r in stack.refusals()), 30, what="the refusal")
    refusal = next(r["evidence"] for r in stack.refusals()
                   if r["evidence"].get("claimed", {}).get("action_id") == close.action_id)
    assert refusal["reason_code"] == "contract_invalid" and refusal["file"] == "ticket.close.yaml"
    assert "tool_called" not in stack.events(close.action_id)
    # Every other action type works on the same workers.
    env = ticket(stack)
    stack.publish(env)
    assert stack.wait_settled(env.action_id).outcome == Outcome.completed_verified
