"""Two worker nodes, each running its own Celery beat, on one ledger and one broker (Redis, and
RabbitMQ).

Both beats schedule the reconciler every second, so two copies of each sweep arrive every period.

- Every action published while the broker lost its message, so only a reconciler re-drive can run
  it: each action is re-driven by one sweeper at a time (two re-drives of one action are never
  closer than the sweep's back-off), both nodes did work, one call and one effect per action.
- Load shared by the two nodes, and one node killed (SIGKILL of its whole process group: the
  supervisor, Celery, its pool and their MCP sessions) while two of its actions sit between the
  call the server applied and the ledger record of it: nothing lost, nothing done twice (the
  witness, outside the system, counts one call per key; the system of record one effect), and the
  ledger names both nodes as actors.
- The sweep runs once per period across the fleet (``recovery/sweep_gate.py``): runs recorded in
  ``sweep_runs`` against the sweep tasks both nodes received, and a node killed while it holds the
  sweep (its run uncommitted: the lock's holder is one of its pool processes) hands it to the other
  one; the dead holder's run leaves no row.
"""

from __future__ import annotations

import os
import signal
import subprocess
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from ledger import store
from ledger.states import ActionStatus, Outcome
from proofline.controller import publish_message
from proofline.ledger_check import check_chains
from proofline_kit.stack import Stack
from recovery.sweep_gate import HOLDER_SQL, lock_name
from tests.conftest import BROKERS, build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import LosingBroker, new_account, refund_env, ticket_env
from worker import faultpoints

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
        rows = [s.wait_settled(env.action_id, timeout=180) for env in envs]
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

        wait_for(lambda: beat_sent("n1") and beat_sent("n2"), 60, what="both beats to have sent a sweep")
    finally:
        teardown_stack(s)


def start_node(s: Stack, name: str) -> tuple[subprocess.Popen, Path]:
    """A worker node with its own beat and its own fault-point file (so a test can arm one node)."""
    points = s.workdir / f"faultpoints-{name}.json"
    proc = start_workers(s, name=name, beat=True, env={**s.env, "PROOFLINE_FAULT_POINTS_FILE": str(points)})[0]
    return proc, points


def node_of(actor: str) -> str:
    """The node prefix (``n1``, ``n2``) of a worker id ``n10-abc123@host:pid``."""
    return actor.split("-", 1)[0][:-1]


def kill_node(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the node's supervisor, Celery, its pool and their servers
    proc.wait(10)


def sweep_runs(s: Stack, since_run: int = 0) -> list[dict[str, Any]]:
    with s.conn.cursor() as cur:
        cur.execute("SELECT * FROM sweep_runs WHERE sweep = 'reconcile' AND run_id > %s ORDER BY run_id", (since_run,))
        return list(cur.fetchall())


def test_two_nodes_share_the_load_and_a_node_killed_mid_flight_loses_and_duplicates_nothing(tmp_path) -> None:
    s = build_stack("stdio", tmp_path)
    try:
        n1, points1 = start_node(s, "n1")
        start_node(s, "n2")
        # First the two nodes share a load with nothing going wrong.
        shared = [refund_env(s, new_account(s)) for _ in range(12)]
        for env in shared:
            s.publish(env)
        for env in shared:
            s.wait_settled(env.action_id, timeout=240)
        # Then both of n1's pool processes stop right after the server applied their call, before
        # the ledger records it (the worst moment to lose a node), and n1 is killed there.
        faultpoints.arm(points1, "after_send", remaining=2, action="hold", seconds=600)
        doomed = [refund_env(s, new_account(s)) for _ in range(10)] + [ticket_env(s) for _ in range(2)]
        for env in doomed:
            s.publish(env)
        envs = shared + doomed
        wait_for(lambda: faultpoints.fired(points1, "after_send") == 2, 180, what="two of n1's actions in flight")
        with s.conn.cursor() as cur:
            cur.execute("SELECT action_id, worker_id FROM leases WHERE released_at IS NULL")
            in_flight = [r["action_id"] for r in cur.fetchall() if node_of(r["worker_id"]) == "n1"]
        assert len(in_flight) == 2, in_flight
        keys = {env.action_id: env.idempotency_key for env in envs}
        assert all(s.witness.count(key=keys[a]) == 1 for a in in_flight)  # the server was handed the call
        last_run = max((r["run_id"] for r in sweep_runs(s)), default=0)
        kill_node(n1)

        rows = [s.wait_settled(env.action_id, timeout=240) for env in envs]
        assert all((r.status, r.outcome) == (ActionStatus.closed, Outcome.completed_verified) for r in rows), \
            [(r.action_id, r.status, r.reason_code) for r in rows]
        finishers: dict[str, str] = {}
        for env in envs:
            assert s.witness.count(key=env.idempotency_key) == 1, env.action_id
            assert s.effects(env.idempotency_key) == 1, env.action_id
            leases = [e["actor"] for e in s.timeline(env.action_id) if e["event"] == "lease_acquired"]
            finishers[env.action_id] = node_of(leases[-1])
        # Both nodes executed actions (the ledger's actors name the node), and n2 finished n1's two.
        assert {finishers[env.action_id] for env in shared} == {"n1", "n2"}, finishers
        assert all(finishers[a] == "n2" for a in in_flight)
        for action_id in in_flight:
            timeline = s.timeline(action_id)
            assert [node_of(e["actor"]) for e in timeline if e["event"] == "lease_acquired"][:1] == ["n1"]
            assert "tool_called" not in [e["event"] for e in timeline if node_of(e["actor"]) == "n1"]
        assert check_chains(s.conn)[2] == []
        # The sweeps went on after the kill, run by n2 alone.
        after = sweep_runs(s, last_run)
        assert after and {node_of(r["holder"]) for r in after} == {"n2"}, after
    finally:
        teardown_stack(s)


def received_sweeps(s: Stack, node: str) -> int:
    log = Path(s.workdir) / f"worker-{node}0.log"
    # One "received" line per copy (its "succeeded" line names the task too, and is not counted).
    return sum(1 for line in log.read_text(errors="replace").splitlines()
               if "Task proofline.reconcile[" in line and "] received" in line)


def test_the_sweep_runs_once_per_period_across_two_beats_and_moves_when_its_holder_dies(tmp_path) -> None:
    s = build_stack("stdio", tmp_path)
    try:
        n1, points1 = start_node(s, "n1")
        n2, _ = start_node(s, "n2")
        wait_for(lambda: sweep_runs(s), 60, what="a first sweep run")
        first_run = sweep_runs(s)[-1]["run_id"]
        received_before = received_sweeps(s, "n1") + received_sweeps(s, "n2")
        wait_for(lambda: len(sweep_runs(s, first_run)) >= 8, 60, what="eight more sweep runs")
        runs = sweep_runs(s, first_run)
        received = received_sweeps(s, "n1") + received_sweeps(s, "n2") - received_before
        slots = [r["slot"] for r in runs]
        assert len(slots) == len(set(slots))
        # Two beats sent about two copies per period, yet one ran per period, and every period had one
        # (allowing two periods whose copies both came late, on this shared machine).
        assert received >= 1.5 * len(runs) - 2, (received, len(runs))
        assert max(slots) - min(slots) + 1 - len(runs) <= 2, slots
        assert {node_of(r["holder"]) for r in runs} <= {"n1", "n2"}

        # n1 takes the sweep and is killed in the middle of it. Each beat ticks once a second at a
        # phase of its own, so the node whose tick comes first in the second wins every period: n2
        # is frozen (SIGSTOP, well under the idle session timeout) until n1 holds one.
        faultpoints.arm(points1, "during_sweep", remaining=1, action="hold", seconds=120)
        os.killpg(n2.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: faultpoints.fired(points1, "during_sweep") == 1, 60, what="n1 to hold a sweep")
        finally:
            os.killpg(n2.pid, signal.SIGCONT)
        # The held run is not committed, so sweep_runs cannot show it: its session holds the lock.
        with store.connect(s.admin_url) as admin:
            [holder] = admin.execute(HOLDER_SQL, (lock_name("reconcile"),)).fetchall()
        assert int(holder["application_name"].rsplit("-", 1)[1]) in descendants(n1.pid), holder
        held_after = sweep_runs(s)[-1]["run_id"]
        # Two more copies reach n2 (two periods' worth, however late its beat is) and must not run.
        n2_before = received_sweeps(s, "n2")
        wait_for(lambda: received_sweeps(s, "n2") >= n2_before + 2, 60, what="two more sweep copies at n2")
        assert sweep_runs(s, held_after) == []
        kill_node(n1)
        wait_for(lambda: len(sweep_runs(s, held_after)) >= 3, 60, what="n2 to take the sweep over")
        after = sweep_runs(s, held_after)
        # The dead holder's run rolled back with its session (no row); every committed run is finished.
        assert {node_of(r["holder"]) for r in after} == {"n2"} and all(r["finished_at"] for r in after)
    finally:
        teardown_stack(s)
