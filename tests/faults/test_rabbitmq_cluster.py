"""A three-node RabbitMQ cluster of the test's own (``proofline_kit/rabbitmq_cluster.py``): the node
that leads the workers' quorum queues is SIGKILLed while several hundred actions are published and
run, then brought back.

Every process (the controller publishing here, the workers, their beat) is given the one URL list
naming the three nodes, first the one that is killed, so every connection is on it when it dies and
every client has to fail over: publishers resend what was in flight (publisher confirms and the
publish retry policy), consumers reconnect to the next node. The reconciler's re-drive is pushed out
of reach, so only the broker path can deliver: nothing may be lost by it, and nothing done twice
(the witness counts one call per key, the system of record one effect). After the failover, with
the killed node still down, a poisoned message still reaches the dead-letter record through the
quorum queue's delivery limit on its new leader. Nothing of the cluster outlives the test.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ledger import store
from ledger.states import ActionStatus, Outcome
from proofline.controller import publish
from proofline.shards import VERIFY_QUEUE, queue_for_tenant
from proofline_kit.rabbitmq_cluster import RabbitCluster
from proofline_kit.rabbitmq_server import available as rabbitmq_available
from proofline_kit.sor import store as sor
from tests.conftest import build_stack, start_workers, teardown_stack, wait_for
from tests.containment.test_dead_letters import BROKER_LIMIT, GUARD_LIMIT, poison
from tests.helpers import log_stamp, new_account, refund_env

ACTIONS = 300
#: The kill comes once this many actions have been published (the rest are published across it).
KILL_AFTER = 100

pytestmark = pytest.mark.timeout(1200)


def settled_count(conn: Any, action_ids: list[str]) -> int:
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) AS n FROM actions WHERE action_id = ANY(%s) AND status = ANY(%s)",
                    (action_ids, [ActionStatus.closed.value, ActionStatus.escalated.value,
                                  ActionStatus.cancelled.value]))
        return int(cur.fetchone()["n"])


def after_kill(workdir: Path, killed: datetime) -> tuple[float, float]:
    """Seconds from the kill to the last worker's reconnection, and to the first task received after
    it, from the workers' log lines (reported, never asserted)."""
    connected: list[float] = []
    received: list[float] = []
    for log in sorted(workdir.glob("worker-*.log")):
        first_connect = first_receipt = None
        for line in log.read_text(errors="replace").splitlines():
            stamp = log_stamp(line)
            if stamp is None:
                continue
            at = (stamp - killed).total_seconds()
            if at <= 0:
                continue
            if first_connect is None and "Connected to amqp://" in line:
                first_connect = at
            elif first_connect is not None and first_receipt is None and "] received" in line:
                first_receipt = at
        connected.append(first_connect if first_connect is not None else float("nan"))
        received.append(first_receipt if first_receipt is not None else float("nan"))
    return max(connected), min(received)


class Publisher(threading.Thread):
    """The controller path (record ``published``, then send) on its own ledger connection, one
    action after another; every exception a publish raised is kept."""

    def __init__(self, s: Any, envs: list[Any]) -> None:
        super().__init__(daemon=True)
        self.s, self.envs = s, envs
        self.sent = 0
        self.failures: list[str] = []
        self.slowest = 0.0

    def run(self) -> None:
        conn = store.connect(self.s.urls["controller"])
        try:
            for env in self.envs:
                started = time.monotonic()
                try:
                    publish(self.s.settings, conn, self.s.app, env)
                except Exception as exc:  # noqa: BLE001 - counted, and the test fails on any
                    self.failures.append(f"{env.action_id}: {type(exc).__name__}: {exc}")
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.sent += 1
        finally:
            conn.close()


def test_the_leader_node_killed_mid_run_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    if not rabbitmq_available():
        pytest.fail("RabbitMQ's scripts are not installed: this test starts a cluster of its own "
                    "(Debian package rabbitmq-server; .ci/run installs it)")
    cluster = RabbitCluster(tmp_path / "cluster")
    try:
        cluster.start()
        s = build_stack("stdio", tmp_path / "stack", broker="rabbitmq", rabbitmq_url=cluster.url, extra_env={
            "PROOFLINE_BROKER_QUORUM_GROUP_SIZE": "3",
            # Only the broker may deliver: a message it lost would leave its action published.
            "PROOFLINE_REDRIVE_AFTER_SECONDS": "3600",
            "PROOFLINE_MAX_UNSETTLED_DELIVERIES": str(GUARD_LIMIT),
            "PROOFLINE_BROKER_DELIVERY_LIMIT": str(BROKER_LIMIT)})
        try:
            start_workers(s, count=2, concurrency=2)
            work_queue = queue_for_tenant("acme", s.settings.tenant_shards)
            verify_queue = queue_for_tenant("acme", s.settings.tenant_shards, VERIFY_QUEUE)
            everyone = sorted(n.node for n in cluster.nodes)
            for queue in (work_queue, verify_queue, "dead_letter", "dead_letter.broker"):
                assert cluster.quorum_members(queue) == everyone, queue
            # Every client connects to the first node of the list, so the queues the workers declared
            # are led from there (RabbitMQ's client-local placement): every client must fail over.
            leader = cluster.node(cluster.queue_leaders()[work_queue])
            assert leader is cluster.nodes[0], (leader.node, cluster.nodes[0].node)

            envs = [refund_env(s, new_account(s)) for _ in range(ACTIONS)]
            ids = [e.action_id for e in envs]
            publisher = Publisher(s, envs)
            started = time.monotonic()
            publisher.start()
            wait_for(lambda: publisher.sent >= KILL_AFTER, 300, interval=0.05, what=f"{KILL_AFTER} publishes")
            before = settled_count(s.conn, ids)
            killed_wall = datetime.now()  # the workers' log lines carry local wall-clock times
            cluster.kill(leader)
            killed_at = time.monotonic()
            # Cheap looks first (one SQL count): rabbitmqctl is slow while a queue has no leader.
            wait_for(lambda: settled_count(s.conn, ids) > before + 4, 120, interval=0.1, what="work after the kill")
            resumed = time.monotonic() - killed_at
            survivor = next(n for n in cluster.nodes if n is not leader)

            def elected_leader() -> str | None:
                now = cluster.queue_leaders(via=survivor).get(work_queue)
                return now if now not in (None, leader.node) else None

            new_leader = wait_for(elected_leader, 120, interval=0.5, what=f"a new leader of {work_queue}")
            publisher.join(600)
            assert not publisher.is_alive(), "the publisher did not finish"
            published_during_outage = publisher.sent - KILL_AFTER
            wait_for(lambda: settled_count(s.conn, ids) == ACTIONS, 600, interval=0.5,
                     what=f"all {ACTIONS} actions settled (now {settled_count(s.conn, ids)})")
            run_seconds = time.monotonic() - started

            assert publisher.failures == [], publisher.failures[:5]
            rows = [s.action(a) for a in ids]
            assert all(r is not None and (r.status, r.outcome) == (ActionStatus.closed, Outcome.completed_verified)
                       for r in rows), Counter((r.status, r.outcome, r.reason_code) for r in rows if r is not None)
            calls = Counter(c.idempotency_key for c in s.witness.calls(tool="issue_refund"))
            effects = [sor.count_effects(s.sor_db, e.idempotency_key) for e in envs]
            lost = sum(1 for e in envs if calls[e.idempotency_key] == 0)
            duplicated = sum(1 for e in envs if calls[e.idempotency_key] > 1)
            assert (lost, duplicated) == (0, 0), (lost, duplicated)
            assert effects == [1] * ACTIONS, Counter(effects)
            with s.conn.cursor() as cur:
                cur.execute("SELECT count(*) AS n FROM ledger_events WHERE event = 'redriven' AND action_id = ANY(%s)",
                            (ids,))
                assert cur.fetchone()["n"] == 0, "an action needed a re-drive: the broker lost its message"

            # The dead-letter path on the new leader, the killed node still down.
            # Its action stays published: the reconciler would re-send it, but not within this test.
            env, records = poison(s, "before_count")
            assert records and all((r["by"], r["broker_reason"]) == ("broker", "delivery_limit") for r in records)
            assert s.action(env.action_id).status == ActionStatus.published
            assert s.effects(env.idempotency_key) == 0

            cluster.restart(leader)
            wait_for(lambda: cluster.quorum_members(work_queue) == everyone, 60, what="three replicas again")
            assert s.workers_alive()
            reconnected, received = after_kill(s.workdir, killed_wall)
            print(f"\ncluster run: {ACTIONS} actions in {run_seconds:.1f} s; leader {leader.node} killed after "
                  f"{KILL_AFTER} publishes, {published_during_outage} published after it; workers reconnected "
                  f"{reconnected:.2f} s and received again {received:.2f} s after the kill, 5 more actions settled "
                  f"{resumed:.2f} s after it; new leader {new_leader}; slowest publish {publisher.slowest:.2f} s; "
                  f"lost {lost}, duplicated {duplicated}; dead letter recorded by {records[0]['by']} "
                  f"({records[0]['broker_reason']})")
        finally:
            teardown_stack(s)
    finally:
        cluster.stop()
    leftovers = cluster.leftovers()
    assert leftovers == [], [(p.pid, p.name()) for p in leftovers]
