"""The node's session host (worker/session_host.py) through real workers and sandboxed, audited
stdio servers: a pool process killed idle or mid-call leaves its servers to its successor, which
starts without launching any (no new server process, no new ``initialize`` on the wire); stopping or
killing the worker leaves no server, tracer or host behind."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from ledger.states import ActionStatus, Outcome
from proofline_kit.processes import gone
from proofline_kit.sor import store as sor
from proofline_kit.stack import build_stack, start_workers, teardown_stack
from tests.conftest import Stack, wait_for
from tests.helpers import new_account, refund_env, sor_processes
from worker.session_host import ID_SPAN


@pytest.fixture(scope="module")
def hosted(tmp_path_factory: pytest.TempPathFactory):
    # The runtime's default of one spare server per identity (test stacks otherwise keep none).
    stack = build_stack("stdio", tmp_path_factory.mktemp("hosted"),
                        extra_env={"PROOFLINE_STDIO_SESSION_HOST": "true", "PROOFLINE_STDIO_SESSION_SPARES": "1"})
    start_workers(stack, count=1, concurrency=2)
    try:
        yield stack
    finally:
        teardown_stack(stack)


def ticket(stack: Stack, title: str, queue: str = "acme-ops"):
    return stack.envelope("ticket.create", arguments={"tenant": "acme", "title": title, "owner": "ops"},
                          target={"type": "ticket_queue", "id": queue})


def run_one(stack: Stack, title: str) -> str:
    env = ticket(stack, title)
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert row.outcome == Outcome.completed_verified, (row.outcome, stack.events(env.action_id))
    assert stack.effects(env.idempotency_key) == 1
    return env.action_id


def owner_of(stack: Stack, action_id: str) -> int:
    with stack.conn.cursor() as cur:
        cur.execute("SELECT owner_pid FROM leases WHERE action_id = %s", (action_id,))
        return cur.fetchone()["owner_pid"]


def host_of(stack: Stack) -> psutil.Process:
    for child in psutil.Process(stack.workers[0].pid).children(recursive=True):
        try:
            if "worker.session_host" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("the worker runs no session host")


def pool_processes(stack: Stack) -> list[int]:
    """The Celery main process's children but the host (its pool processes, and beat's)."""
    host = host_of(stack)
    pids = []
    for p in host.parent().children():
        try:  # a pool process that exits between the listing and the look is not one
            if p.pid != host.pid and p.status() != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def both_busy(stack: Stack) -> list[str]:
    """Two actions held in the server at once: each pool process runs one (and holds its sessions)."""
    for attempt in range(3):
        sor.set_fault(stack.sor_db, "create_ticket", "delay", remaining=2, delay_seconds=2.0)
        envs = [ticket(stack, f"busy {attempt} {n}", f"acme-busy-{attempt}-{n}") for n in range(2)]  # no shared target
        for env in envs:
            stack.publish(env)
        for env in envs:
            assert stack.wait_settled(env.action_id).outcome == Outcome.completed_verified
        if len({owner_of(stack, e.action_id) for e in envs}) == 2:
            return [e.action_id for e in envs]
    raise AssertionError("one pool process took both held actions three times")


def served_by(stack: Stack, pid: int, titles: str, limit: int = 4) -> list[str]:
    """Run pairs of held actions (both pool processes busy) until ``pid`` has executed one."""
    done = []
    for n in range(limit):
        sor.set_fault(stack.sor_db, "create_ticket", "delay", remaining=2, delay_seconds=2.0)
        envs = [ticket(stack, f"{titles} {n} {k}", f"acme-{titles}-{n}-{k}") for k in range(2)]
        for env in envs:
            stack.publish(env)
        for env in envs:
            assert stack.wait_settled(env.action_id).outcome == Outcome.completed_verified
            assert stack.effects(env.idempotency_key) == 1
            done.append(env.action_id)
        mine = [e.action_id for e in envs if owner_of(stack, e.action_id) == pid]
        if mine:
            return done[:-2] + [a for a in done[-2:] if a not in mine] + mine  # its own action last
    raise AssertionError(f"pool process {pid} took none of {2 * limit} actions")


def test_the_servers_run_under_the_host_not_under_the_pool_processes(hosted: Stack) -> None:
    run_one(hosted, "warm")
    host = host_of(hosted)
    servers = sor_processes(hosted)
    assert servers
    under_host = {p.pid for p in host.children(recursive=True)}
    assert all(p.pid in under_host for p in servers), "every stdio server is the host's, none a pool process's"
    for pid in pool_processes(hosted):
        assert not [c for c in psutil.Process(pid).children(recursive=True) if c.name().startswith("python")]


def test_a_killed_pool_process_leaves_its_servers_to_its_successor(hosted: Stack) -> None:
    # Both pool processes busy at once, so that each holds a writer and a reader session.
    done = both_busy(hosted)
    pools = pool_processes(hosted)
    # Two borrowed servers per pool process (writer, reader) and the host's spare for each identity.
    wait_for(lambda: len(sor_processes(hosted)) == 2 * 2 + 2, 60, what="the host's spares to start")
    servers = {p.pid for p in sor_processes(hosted)}
    mark = hosted.witness.mark()
    victim = owner_of(hosted, done[-1])
    assert victim in pools
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len(set(pool_processes(hosted)) - set(pools)) == 1, 30, what="Celery to replace the pool process")
    (successor,) = set(pool_processes(hosted)) - set(pools)
    done_after = served_by(hosted, successor, "after")
    # The successor borrowed the servers the killed process had: nothing new was started, and no
    # server was asked to initialize again (a handshake the host answers from the first one; the
    # demo server speaks the 2026-07-28 protocol, whose discovery each new client sends anew).
    assert {p.pid for p in sor_processes(hosted)} == servers
    assert hosted.witness.requests(method="initialize", since=mark) == []
    # Its requests carried ids past every id an earlier borrower of the same server could mint, so
    # a late answer to the killed process's call can never be taken for one of the successor's.
    calls = hosted.witness.calls(since=mark)
    successors = [c for c in calls if c.action_id == done_after[-1]]
    assert successors and all(isinstance(c.id, int) and c.id > ID_SPAN for c in successors)


def test_a_pool_process_killed_mid_call_leaves_one_effect_and_a_live_server(hosted: Stack) -> None:
    run_one(hosted, "warm again")
    env = refund_env(hosted, new_account(hosted), amount=700)
    sor.set_fault(hosted.sor_db, "issue_refund", "delay", remaining=1, delay_seconds=3.0)
    # The writers as they stand once none is on its way out: an earlier test's killed borrower may
    # have left a server that the host is stopping (it gets STOP_SECONDS to exit), which is not one
    # this test's kill could keep. The same set three seconds apart is taken as settled. Only the
    # writers: the call goes to one of them, while a reader whose read timed out on a loaded machine
    # is retired and replaced as it should be (a whole run on a slow day saw two go).
    def settled_servers() -> set[int] | None:
        before = {p.pid for p in sor_processes(hosted, role="writer")}
        time.sleep(3)
        return before if before == {p.pid for p in sor_processes(hosted, role="writer")} else None

    servers = wait_for(settled_servers, 60, what="a settled set of servers")
    mark = hosted.witness.mark()
    hosted.publish(env)
    wait_for(lambda: hosted.witness.count(key=env.idempotency_key, since=mark) >= 1, 60,
             what="the refund call to reach the server")
    os.kill(owner_of(hosted, env.action_id), signal.SIGKILL)
    row = hosted.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert hosted.effects(env.idempotency_key) == 1
    # The host cancelled the dead borrower's call on its behalf, and kept the server.
    first = hosted.witness.calls(key=env.idempotency_key, since=mark)[0]
    assert first.cancelled
    after = {p.pid for p in sor_processes(hosted, role="writer")}
    assert servers <= after, f"writers before the kill {sorted(servers)}, after it {sorted(after)}"


def test_a_host_that_dies_is_started_again_and_serves_the_next_actions(hosted: Stack) -> None:
    run_one(hosted, "before the host dies")
    old = host_of(hosted)
    old_servers = [p for p in sor_processes(hosted)]
    old.kill()
    wait_for(lambda: all(gone(p) for p in old_servers), 30, what="the dead host's servers to end with it")
    wait_for(lambda: host_of_or_none(hosted) not in (None, old.pid), 60, what="a new session host")
    wait_for(lambda: accepts(host_of(hosted)), 60, what="the new session host to listen")
    for n in range(3):
        run_one(hosted, f"after the host died {n}")
    new = host_of(hosted)
    under_new = {p.pid for p in new.children(recursive=True)}
    # The new host lent servers for those actions (it starts one only for a checkout). A pool process
    # that could not reach a host at some moment (a loaded machine, the restart's gap) keeps the
    # servers it started itself, by design, so not every server on the node need be the host's.
    assert any(p.pid in under_new for p in sor_processes(hosted)), [p.pid for p in sor_processes(hosted)]


def accepts(host: psutil.Process) -> bool:
    argv = host.cmdline()
    path = argv[argv.index("--socket") + 1]
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def host_of_or_none(stack: Stack) -> int | None:
    try:
        return host_of(stack).pid
    except AssertionError:
        return None


def test_stopping_or_killing_the_worker_leaves_nothing_behind(tmp_path: Path) -> None:
    for how in (signal.SIGTERM, signal.SIGKILL):
        stack = build_stack("stdio", tmp_path / how.name, extra_env={"PROOFLINE_STDIO_SESSION_HOST": "true"})
        try:
            start_workers(stack, count=1, concurrency=1, beat=False)
            run_one(stack, f"then {how.name}")
            host = host_of(stack)
            celery = host.parent()
            tree = [host, *host.children(recursive=True)]
            assert any("strace" in p.name() for p in tree), "the servers run audited"
            folders = [f for f in os.listdir(tempfile.gettempdir()) if f.startswith(f"proofline-host-{celery.pid}-")]
            assert folders
            celery.send_signal(how)
            wait_for(lambda tree=tree: all(gone(p) for p in tree), 30, what=f"the host and its servers to end after {how.name}")
        finally:
            teardown_stack(stack)
