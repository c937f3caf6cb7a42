"""Poison messages on both brokers: the message guard's dead-lettering (counted in Postgres) and,
on RabbitMQ, the quorum queue's own delivery limit behind it. Either way the message ends in
``dead_letter`` with one ``dead_lettered`` record naming who moved it, and the action is not lost."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import psutil
import pytest
from kombu import Connection

from ledger.states import ActionStatus, Outcome
from tests.conftest import BROKERS, Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.containment.helpers import celery_main_pid, worker_log, worker_starts
from tests.helpers import log_stamp, ticket_env
from worker import faultpoints
from worker.broker import INBOX

GUARD_LIMIT = 3
BROKER_LIMIT = 5
#: How long a broker dead letter the ledger could not record waits before it is requeued.
RECORD_RETRY = 20


@pytest.fixture(scope="module", params=BROKERS)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp(f"dead-letters-{request.param}")
    s = build_stack("stdio", tmp, broker=request.param, extra_env={
        "PROOFLINE_MAX_UNSETTLED_DELIVERIES": str(GUARD_LIMIT), "PROOFLINE_BROKER_DELIVERY_LIMIT": str(BROKER_LIMIT),
        "PROOFLINE_DEAD_LETTER_RETRY_SECONDS": str(RECORD_RETRY)})
    try:
        start_workers(s)
        yield s
    finally:
        teardown_stack(s)


def dead_letter_records(stack: Stack, action_id: str) -> list[dict[str, Any]]:
    with stack.conn.cursor() as cur:
        cur.execute("SELECT evidence FROM ledger_events WHERE event = 'dead_lettered' AND "
                    "evidence->'claimed'->>'action_id' = %s ORDER BY id", (action_id,))
        return [r["evidence"] for r in cur.fetchall()]


def poison(stack: Stack, *points: str) -> tuple[Any, list[dict[str, Any]]]:
    """Publish an action whose every delivery crashes its pool process (SIGSEGV; plus ``points``), and wait for
    its dead-letter records; then let deliveries live again.

    The action stays ``published`` while its message dies, so the reconciler may re-send it; each
    message whose deliveries all die is dead-lettered on its own. So there is one record per
    message, never two for one message, and each message a record names is in ``dead_letter``."""
    env = ticket_env(stack)
    # Armed for this action only: a message of an earlier test (a re-send of its action) is spared.
    for point in ("on_delivery", *points):
        faultpoints.arm(stack.faultpoints, point, remaining=1000, action="raise" if point == "before_count" else "crash",
                        action_id=env.action_id)
    try:
        stack.publish(env)
        records = wait_for(lambda: dead_letter_records(stack, env.action_id), 120, what="a dead_lettered record")
    finally:
        for point in ("on_delivery", *points):
            faultpoints.arm(stack.faultpoints, point, remaining=0)
    moved = [r["message_key"].removeprefix("task:") for r in records]
    assert len(set(moved)) == len(moved), records
    # The record is written before the message is moved, so the move may trail it a moment.
    wait_for(lambda: set(moved) <= set(stack.queued("dead_letter")), 30, what="the dead-lettered messages in dead_letter")
    return env, records


def test_the_guard_dead_letters_first_on_either_broker(stack: Stack) -> None:
    """Counted in Postgres, the guard moves the message after GUARD_LIMIT deaths, before the
    broker's higher limit could: its record says so, with the count."""
    env, records = poison(stack)
    for record in records:
        assert (record["by"], record["deliveries"], record["unsettled"]) == ("consumer", GUARD_LIMIT + 1, GUARD_LIMIT + 1)
        assert record["queue"] == "dead_letter"
    # The action stays published; once deliveries survive again, the reconciler's re-send runs it.
    row = stack.wait_settled(env.action_id, timeout=90)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert stack.effects(env.idempotency_key) == 1


def test_a_process_killed_from_outside_is_not_counted_against_its_message(stack: Stack) -> None:
    """The pool process is SIGKILLed as its delivery starts, more times than the guard's limit
    (an operator or a chaos tool would do the same from outside): each death is excused, not
    counted, so the message is never dead-lettered and the action completes once, without waiting
    for the reconciler. Its crashing counterpart (SIGSEGV) is :func:`poison`."""
    kills = GUARD_LIMIT + 1
    env = ticket_env(stack)
    before = faultpoints.fired(stack.faultpoints, "on_delivery")
    faultpoints.arm(stack.faultpoints, "on_delivery", remaining=kills, action="kill", action_id=env.action_id)
    try:
        stack.publish(env)
        row = stack.wait_settled(env.action_id, timeout=50)  # under the reconciler's 60 s re-send
    finally:
        faultpoints.arm(stack.faultpoints, "on_delivery", remaining=0)
    assert faultpoints.fired(stack.faultpoints, "on_delivery") - before == kills
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert stack.effects(env.idempotency_key) == 1
    assert dead_letter_records(stack, env.action_id) == []

    def rows() -> list[dict[str, Any]]:
        with stack.conn.cursor() as cur:
            cur.execute("SELECT excused, unsettled, dead_lettered_at FROM message_deliveries WHERE action_id = %s",
                        (env.action_id,))
            return cur.fetchall()

    # Every death excused, on whichever of the action's messages (its task and a re-send) it hit. The
    # last kill may have hit the other message while this one completed, and Celery can take up to
    # its pool-maintenance interval (5 s) to notice a process that died as it started: wait for it.
    def all_excused() -> list[dict[str, Any]] | None:
        now = rows()
        return now if sum(r["excused"] for r in now) >= kills else None

    seen = wait_for(all_excused, 30, what=f"{kills} excused deliveries")
    assert sum(r["excused"] for r in seen) == kills and all(r["dead_lettered_at"] is None for r in seen), seen
    assert "delivery lost to an outside kill" in worker_log(stack)


#: A process in one of these states runs no more code of its own (a traced one stops for its tracer).
HALTED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def kill_worker_tree(stack: Stack) -> list[psutil.Process]:
    """SIGKILL of everything under the first worker's supervisor (Celery's main process, its pool,
    their servers), as a container runtime or ``kill -9`` of the process group does; returns the
    killed processes, not yet waited for. The supervisor (``proofline worker``) lives on and starts
    the next run a second after the main process is gone: what must be read before that run can
    act is read before waiting for these (under load the wait alone can take longer).

    The tree is frozen before it is read, as a cgroup freezer would: each process is stopped and
    seen stopped before its children are listed, so none can fork one this list misses (a pool
    process forked from the main process holds a copy of its broker connection, and one left
    alive would keep the killed run's messages from the broker's other consumers)."""
    tree: list[psutil.Process] = []
    frontier = [psutil.Process(celery_main_pid(stack))]
    while frontier:
        proc = frontier.pop()
        tree.append(proc)
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            proc.suspend()
            deadline = time.monotonic() + 5
            while proc.status() not in HALTED and time.monotonic() < deadline:
                time.sleep(0.005)
            frontier.extend(proc.children())
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    return tree


# RabbitMQ only: Redis hands a dead consumer's messages back after its visibility timeout (hours).
@pytest.mark.parametrize("stack", ["rabbitmq"], indirect=True)
def test_a_worker_killed_from_outside_is_not_counted_against_what_it_held(stack: Stack) -> None:
    """The whole worker (Celery's main process and its pool) is SIGKILLed while its message is held
    at the start of its delivery, more times than the guard's limit. RabbitMQ hands the message back
    at once, redelivered, and the guard would count each time; the supervisor excuses what the
    killed run held before it starts the next, so the message is never dead-lettered and the action
    completes once."""
    kills = GUARD_LIMIT + 1
    env = ticket_env(stack)
    starts = worker_starts(stack)
    # Every delivery is held until the last run is killed: each run killed holds the action's message
    # (or a re-send of it, or both: a run may hold two, so runs are counted, not holds).
    faultpoints.arm(stack.faultpoints, "on_delivery", remaining=1000, action="hold", seconds=120,
                    action_id=env.action_id)
    try:
        held_before = faultpoints.fired(stack.faultpoints, "on_delivery")
        stack.publish(env)
        for run in range(1, kills + 1):
            wait_for(lambda held_before=held_before: faultpoints.fired(stack.faultpoints, "on_delivery") > held_before,
                     120, what=f"a delivery held in run {run}")
            # A run shorter than the supervisor's early-exit bound (5 s) would read as bad setup.
            main = psutil.Process(celery_main_pid(stack))
            time.sleep(max(0.0, 6.0 - (time.time() - main.create_time())))
            killed = kill_worker_tree(stack)
            # At once, before the next run can start (the supervisor waits a second at least): a
            # killed process holds nothing more, and a hold of the next run must not be counted here.
            if run == kills:
                faultpoints.release(stack.faultpoints, "on_delivery")  # its deliveries go through
            held_before = faultpoints.fired(stack.faultpoints, "on_delivery")
            psutil.wait_procs(killed, timeout=15)
            wait_for(lambda run=run: worker_starts(stack) >= starts + run, 90, what=f"run {run + 1} started")
        row = stack.wait_settled(env.action_id, timeout=120)
        assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
        assert stack.effects(env.idempotency_key) == 1
        assert dead_letter_records(stack, env.action_id) == []
        with stack.conn.cursor() as cur:
            cur.execute("SELECT excused, dead_lettered_at FROM message_deliveries WHERE action_id = %s",
                        (env.action_id,))
            rows = cur.fetchall()
        # Each killed run held the action's message (and maybe a re-send of it): one excuse per run at least.
        assert sum(r["excused"] for r in rows) >= kills and all(r["dead_lettered_at"] is None for r in rows), rows
        assert worker_log(stack).count("held when it ended") >= kills
    except AssertionError as exc:  # what the supervisor and the runs said, for a failure in CI
        lines = [line for line in worker_log(stack).splitlines() if "proofline:" in line or "excuse" in line
                 or "dead-letter" in line or "ERROR" in line]
        last_run = worker_log(stack).rsplit("proofline: worker started", 1)[-1].splitlines()
        raise AssertionError(f"{exc}\n" + "\n".join(lines[-40:]) + "\n--- the last run's log ---\n"
                             + "\n".join(last_run[-60:])) from None
    finally:
        faultpoints.release(stack.faultpoints, "on_delivery")


@pytest.mark.parametrize("stack", ["rabbitmq"], indirect=True)  # Redis has no delivery limit
def test_the_broker_limit_catches_what_the_guard_could_not_count(stack: Stack) -> None:
    """RabbitMQ only: the consumer cannot count (as when Postgres is away), so the guard never
    dead-letters; the quorum queue does, after BROKER_LIMIT + 1 failed deliveries, into the inbox.
    The consumer records it (``by: broker``, RabbitMQ's reason) and moves it to ``dead_letter``."""
    # Only this test's part of the log: on RabbitMQ an earlier test's message can be dead-lettered by
    # the broker too (the quorum queue counts the deliveries the guard excused), so the log may
    # already hold a broker dead-letter line of another action.
    start = len(worker_log(stack))
    env, records = poison(stack, "before_count")
    for record in records:
        assert (record["by"], record["broker_reason"]) == ("broker", "delivery_limit"), record
        assert record["deliveries"] == BROKER_LIMIT + 1 and record["from_queue"].startswith("actions")
    # The consumer logs after recording and moving: the line may trail the record by a moment.
    dead_line = f"dead-lettered by the broker (delivery_limit) action_id={env.action_id}"
    wait_for(lambda: dead_line in worker_log(stack)[start:], 10, what="the log line")
    # The guard saw redeliveries it could not count before the broker gave up (so it was the broker's
    # limit that caught the message, as the records say). How many of the deliveries reach the guard
    # flagged as redelivered depends on how the crashes fall, and lines after the broker's
    # dead-letter belong to the reconciler's re-send; so this asks for one at least.
    before = worker_log(stack)[start:].split(dead_line, 1)[0]
    assert before.count("delivery not counted") >= 1, before[-3000:]
    assert stack.queued(INBOX) == []
    row = stack.wait_settled(env.action_id, timeout=90)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert stack.effects(env.idempotency_key) == 1


@pytest.mark.parametrize("stack", ["rabbitmq"], indirect=True)  # the broker's dead letters: RabbitMQ only
def test_a_failed_move_is_retried_without_a_second_record(stack: Stack) -> None:
    """The broker's dead letter is recorded, its move to ``dead_letter`` fails once, and it is
    requeued: the next delivery finds the record and only moves it. One record per message."""
    before = faultpoints.fired(stack.faultpoints, "before_dead_letter_move")
    faultpoints.arm(stack.faultpoints, "before_dead_letter_move", remaining=1, action="raise")
    try:
        env, _ = poison(stack, "before_count")
    finally:
        faultpoints.arm(stack.faultpoints, "before_dead_letter_move", remaining=0)
    assert faultpoints.fired(stack.faultpoints, "before_dead_letter_move") - before == 1
    assert "dead-letter move failed" in worker_log(stack)
    # poison() returned once the message sat in dead_letter: after its second delivery, so a second
    # record (written before that move) would be here by now.
    records = dead_letter_records(stack, env.action_id)
    keys = [r["message_key"] for r in records]
    assert records and len(set(keys)) == len(keys), records
    assert all(r["by"] == "broker" for r in records), records
    # A copy the reconciler re-sent while deliveries still died is a message of its own, recorded
    # once too, and its move may trail its record (as in poison()).
    wait_for(lambda: {k.removeprefix("task:") for k in keys} <= set(stack.queued("dead_letter")), 30,
             what="every recorded message in dead_letter")
    wait_for(lambda: stack.queued(INBOX) == [], 30, what="an empty inbox")
    row = stack.wait_settled(env.action_id, timeout=90)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)


def records_of_message(stack: Stack, key: str) -> list[dict[str, Any]]:
    with stack.conn.cursor() as cur:
        cur.execute("SELECT evidence FROM ledger_events WHERE event = 'dead_lettered' AND "
                    "evidence->>'message_key' = %s ORDER BY id", (key,))
        return [r["evidence"] for r in cur.fetchall()]


@pytest.mark.parametrize("stack", ["rabbitmq"], indirect=True)  # the broker's dead letters: RabbitMQ only
def test_an_unrecorded_dead_letter_waits_without_stalling_the_worker(stack: Stack) -> None:
    """The recorder cannot write (the test-only point stands in for the ledger being away), so the
    message waits RECORD_RETRY seconds, unacknowledged, on the event loop's timer. Meanwhile the same
    worker's main process receives an action, which then settles. Had the recorder slept instead,
    the main process could receive nothing before the wait ended: the action's task would be
    received only after the dead letter was recorded. The worker's log orders the two on one clock
    (a deadline of RECORD_RETRY seconds for the whole action failed on a loaded machine, where the
    action was received at once and its pool process took 13 s to start it)."""
    task_id = str(uuid.uuid4())
    before = faultpoints.fired(stack.faultpoints, "before_dead_letter_record")
    faultpoints.arm(stack.faultpoints, "before_dead_letter_record", remaining=1, action="raise")
    try:
        with Connection(stack.broker_url) as conn:
            conn.Producer().publish(b"not a task", exchange="", routing_key=INBOX, headers={"id": task_id},
                                    content_type="application/octet-stream", content_encoding="binary")
        wait_for(lambda: faultpoints.fired(stack.faultpoints, "before_dead_letter_record") > before, 30,
                 what="the recorder's failed attempt")
        env = ticket_env(stack)
        stack.publish(env)
        received = wait_for(lambda: log_time(stack, "Task proofline.execute[", "received", env.action_id), 60,
                            what="the action's task received by the worker's main process")
        row = stack.wait_settled(env.action_id)
        assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    finally:
        faultpoints.arm(stack.faultpoints, "before_dead_letter_record", remaining=0)
    assert "broker dead-letter not recorded; requeued" in worker_log(stack)
    records = wait_for(lambda: records_of_message(stack, "task:" + task_id), RECORD_RETRY + 60,
                       what="the dead letter recorded after its requeue")
    assert len(records) == 1 and records[0]["by"] == "broker", records
    # The worker logs the record once it is written: a moment after the ledger has it.
    recorded = wait_for(lambda: log_time(stack, "message dead-lettered by the broker", f"message_key=task:{task_id}"),
                        30, what="the worker's log line for the recorded dead letter")
    assert received < recorded, (received, recorded)
    wait_for(lambda: task_id in stack.queued("dead_letter"), 30, what="the message in dead_letter")
    assert stack.queued(INBOX) == []


def log_time(stack: Stack, *parts: str) -> datetime | None:
    """When the first worker log line holding every one of ``parts`` was written (Celery's own
    timestamp), or None."""
    for line in worker_log(stack).splitlines():
        stamp = log_stamp(line)
        if stamp is not None and all(part in line for part in parts):
            return stamp
    return None
