"""MCP sessions in the worker: minimal environment for stdio servers, reuse across tasks,
replacement of a dead session, bounded progress records, and a worker killed mid-call."""

from __future__ import annotations

import os
import signal

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.settings import Settings
from proofline_kit.processes import gone
from proofline_kit.sor import store as sor
from tests.conftest import CANARY_SECRET, Stack, wait_for
from tests.helpers import new_account, refund_env, sor_processes


def ticket(stack: Stack, title: str = "disk full"):
    return stack.envelope("ticket.create", arguments={"tenant": "acme", "title": title, "owner": "ops"},
                          target={"type": "ticket_queue", "id": "acme-ops"})


def run_one(stack: Stack, env) -> None:
    stack.publish(env)
    assert stack.wait_settled(env.action_id).outcome == Outcome.completed_verified


def test_stdio_servers_start_with_a_minimal_environment(stack: Stack) -> None:
    run_one(stack, ticket(stack))
    processes = sor_processes(stack)
    assert processes, "the worker should hold stdio sessions open"
    for proc in processes:
        environ = proc.environ()
        assert CANARY_SECRET not in environ.values()
        assert "AWS_SECRET_ACCESS_KEY" not in environ
        assert environ["SOR_ROLE"] in ("writer", "reader")
        assert set(environ) <= {"PATH", "LANG", "SOR_ROLE", "SOR_DB", "SOR_VERSION", "SOR_CONTRACT_VARIANT",
                                "SOR_RESTART_SECONDS", "PYTHONPATH", "HOME", "LOGNAME", "SHELL", "TERM", "USER",
                                "PWD"}  # PWD: bwrap's --chdir sets it to the sandbox's working directory
        assert proc.cwd() == str(stack.servers_file.parent / "var")
    roles = sorted(p.environ()["SOR_ROLE"] for p in processes)
    assert "reader" in roles, "verification must use its own read-only identity"


def test_sessions_are_reused_across_tasks(stack: Stack) -> None:
    run_one(stack, ticket(stack))
    before = {p.pid for p in sor_processes(stack)}
    for n in range(6):
        run_one(stack, ticket(stack, f"batch {n}"))
    after = {p.pid for p in sor_processes(stack)}
    # Two pool processes, each with at most a writer and a reader session, and the session host's
    # spare for each identity (worker/session_host.py): never one per task.
    assert len(after) <= 2 * 2 + 2 * int(stack.env.get("PROOFLINE_STDIO_SESSION_SPARES", Settings().stdio_session_spares))
    assert before & after, "sessions opened earlier should still be serving"


def test_a_dead_stdio_session_is_replaced(stack: Stack) -> None:
    run_one(stack, ticket(stack))
    for proc in sor_processes(stack):
        proc.kill()
    wait_for(lambda: not sor_processes(stack) or all(gone(p) for p in sor_processes(stack)), 10, what="servers gone")
    # The next actions find their session dead and open a new one; nothing is lost. A dead session
    # noticed only once a request was sent is an unknown outcome, which verification settles by
    # reading (and recovery retries with the same key when the effect proves absent).
    for n in range(3):
        env = ticket(stack, f"after kill {n}")
        stack.publish(env)
        row = stack.wait_settled(env.action_id)
        assert row.outcome == Outcome.completed_verified
        assert stack.effects(env.idempotency_key) == 1
    env = ticket(stack, "steady again")
    run_one(stack, env)


@pytest.mark.parametrize("stack", ["stdio", "http"], indirect=True)
def test_worker_killed_mid_call_is_reconciled_not_called_again(stack: Stack) -> None:
    env = refund_env(stack, new_account(stack), amount=700)
    sor.set_fault(stack.sor_db, "issue_refund", "delay", remaining=1, delay_seconds=2.0)
    stack.publish(env)
    stack.wait_event(env.action_id, "preconditions_passed")
    with stack.conn.cursor() as cur:
        cur.execute("SELECT owner_pid FROM leases WHERE action_id = %s", (env.action_id,))
        owner = cur.fetchone()["owner_pid"]
    os.kill(owner, signal.SIGKILL)
    # Celery requeues the message (acks_late, reject_on_worker_lost); the next holder finds the
    # claim in progress under a dead lease and reconciles instead of calling again.
    stack.wait_event(env.action_id, "reconcile_required", timeout=60)
    events = stack.events(env.action_id)
    reconcile_at = events.index("reconcile_required")
    assert "tool_called" not in events[:reconcile_at]  # the killed worker never recorded a result
    row = stack.wait_settled(env.action_id)
    # Whether or not the killed call reached the server, the action ends with exactly one refund:
    # verification either finds it, or proves it absent and recovery retries with the same key.
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert stack.effects(env.idempotency_key) == 1
    events = stack.events(env.action_id)
    if events.count("tool_called"):
        decided = [e for e in stack.timeline(env.action_id) if e["event"] == "recovery_decided"]
        assert decided and decided[0]["evidence"]["decision"] == "retry"
        assert decided[0]["evidence"]["facts"]["finding"] == "absent"
    wait_for(stack.workers_alive, 10, what="Celery to replace the killed pool process")
