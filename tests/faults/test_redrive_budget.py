"""Lost messages are re-sent within the fleet's re-drive budget, and every one still drains.

Actions are published while no worker runs, and their messages are then deleted from the broker:
a backlog of published actions whose messages were lost (as Redis without persistence loses them
when it dies). Workers start; the reconciler (beat, every second here) must re-send every one from
the ledger, but no sweep more than its budget (``recovery/redrive_budget.py``): the drain measured
over the last periods, at least ``PROOFLINE_REDRIVE_BUDGET_MIN``. Before the budget, the first
sweep re-sent the whole backlog at once (its limit was 200 a sweep); after a long fault that was
about 10,000 copies a minute competing with the work they were meant to recover.
"""

from __future__ import annotations

from pathlib import Path

from ledger import store
from proofline_kit.stack import redis_client
from tests.conftest import build_stack, start_workers, teardown_stack
from tests.helpers import new_account, refund_env

LOST = 24
FLOOR = 3


def _reconcile_runs(stack) -> list[dict]:
    with store.connect(stack.admin_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT run_id, counts FROM sweep_runs WHERE sweep = 'reconcile' AND finished_at IS NOT NULL "
                    "ORDER BY run_id")
        return list(cur.fetchall())


def test_a_lost_backlog_is_re_driven_within_the_budget_and_drains(tmp_path: Path) -> None:
    s = build_stack("stdio", tmp_path, extra_env={"PROOFLINE_REDRIVE_BUDGET_MIN": str(FLOOR)})
    try:
        envs = [refund_env(s, new_account(s)) for _ in range(LOST)]  # one target each: none waits on another
        for env in envs:
            s.publish(env)
        client = redis_client(s)
        queues = [key for key in client.keys("actions*") if client.type(key) == b"list"]
        assert queues and sum(client.llen(q) for q in queues) == LOST
        client.delete(*queues)  # the broker lost every message; the ledger still has every action
        start_workers(s)
        rows = [s.wait_settled(e.action_id, timeout=240) for e in envs]
        assert all(r.outcome is not None and r.outcome.value == "completed_verified" for r in rows), rows
        assert all(s.effects(e.idempotency_key) == 1 for e in envs)
        assert all("redriven" in s.events(e.action_id) for e in envs)
        runs = [r for r in _reconcile_runs(s) if r["counts"].get("not_started")]
        assert runs, "the reconciler re-drove nothing"
        # Nothing had drained when the first re-drives went out: the floor, not the whole backlog.
        assert runs[0]["counts"]["not_started"] <= FLOOR, runs[0]
        assert max(r["counts"]["not_started"] for r in runs) < LOST, runs
        for run in runs:
            counts = run["counts"]
            assert counts["not_started"] <= counts["redrive_budget"], run
        assert s.workers_alive()
    finally:
        teardown_stack(s)
