"""Two worker nodes, each running its own Celery beat, on one ledger and one broker (Redis, and
RabbitMQ).

Both beats schedule the reconciler every second, so two sweeps race for the same rows all the
time. Every action here was published while the broker lost its message, so only a reconciler
re-drive can run it. What must hold: each action is re-driven by one sweeper at a time (two
re-drives of one action are never closer than the sweep's back-off: a second sweeper skipped the
row the first had claimed), both nodes did work, every action is verified with exactly one call
handed to the server and one effect, and every chain still verifies.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.controller import publish_message
from proofline.ledger_check import check_chains
from tests.conftest import BROKERS, build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import LosingBroker, new_account, refund_env, ticket_env

REDRIVE_AFTER = 3.0


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (a node's Celery process and its pool)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


@pytest.mark.parametrize("broker", BROKERS)
def test_two_nodes_with_two_beats_redrive_each_action_once(tmp_path, broker: str) -> None:
    s = build_stack("stdio", tmp_path, broker=broker, extra_env={"PROOFLINE_REDRIVE_AFTER_SECONDS": str(REDRIVE_AFTER)})
    try:
        nodes = {"n1": start_workers(s, name="n1", beat=True)[0], "n2": start_workers(s, name="n2", beat=True)[0]}
        envs = [ticket_env(s) for _ in range(4)] + [refund_env(s, new_account(s)) for _ in range(4)]
        broker = LosingBroker()
        for env in envs:
            publish_message(s.conn, broker, s.message(env), env, settings=s.settings)
        assert len(broker.lost) == len(envs)
        rows = [s.wait_settled(env.action_id, timeout=90) for env in envs]
        assert all((r.status, r.outcome) == (ActionStatus.closed, Outcome.completed_verified) for r in rows), \
            [(r.action_id, r.status, r.reason_code) for r in rows]

        pids = {name: descendants(proc.pid) for name, proc in nodes.items()}
        actors: set[int] = set()
        for env in envs:
            timeline = s.timeline(env.action_id)
            redrives = [e for e in timeline if e["event"] == "redriven"]
            assert redrives, f"{env.action_id} ran without a re-drive: the lost message was delivered?"
            gaps = [(b["at"] - a["at"]).total_seconds() for a, b in pairwise(redrives)]
            assert all(g >= REDRIVE_AFTER - 0.5 for g in gaps), (env.action_id, gaps)
            assert [e["event"] for e in timeline].count("tool_called") == 1
            assert s.witness.count(key=env.idempotency_key) == 1
            assert s.effects(env.idempotency_key) == 1
            actors.update(int(e["actor"].rsplit(":", 1)[1]) for e in timeline
                          if e["event"] in ("redriven", "validated"))
        # Both nodes did work (a worker id is host:pid of the pool process that wrote the event).
        assert actors & pids["n1"] and actors & pids["n2"], (actors, pids)
        assert check_chains(s.conn)[2] == []

        # Both beats really ran: each node's log shows its scheduler sending the reconcile task.
        def beat_sent(node: str) -> bool:
            log = Path(s.workdir) / f"worker-{node}0.log"
            return "Sending due task proofline-reconcile" in log.read_text(errors="replace")

        wait_for(lambda: beat_sent("n1") and beat_sent("n2"), 10, what="both beats to have sent a sweep")
    finally:
        teardown_stack(s)
