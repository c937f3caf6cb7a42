"""Poison messages on both brokers: the message guard's dead-lettering (counted in Postgres) and,
on RabbitMQ, the quorum queue's own delivery limit behind it. Either way the message ends in
``dead_letter`` with one ``dead_lettered`` record naming who moved it, and the action is not lost."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection

from ledger.states import ActionStatus, Outcome
from tests.conftest import BROKERS, Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.containment.helpers import worker_log
from tests.helpers import ticket_env
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
    """Publish an action whose every delivery kills its pool process (plus ``points``), and wait for
    its dead-letter records; then let deliveries live again.

    The action stays ``published`` while its message dies, so the reconciler may re-send it; each
    message whose deliveries all die is dead-lettered on its own. So there is one record per
    message, never two for one message, and each message a record names is in ``dead_letter``."""
    for point in ("on_delivery", *points):
        faultpoints.arm(stack.faultpoints, point, remaining=1000, action="raise" if point == "before_count" else "kill")
    try:
        env = ticket_env(stack)
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


@pytest.mark.parametrize("stack", ["rabbitmq"], indirect=True)  # Redis has no delivery limit
def test_the_broker_limit_catches_what_the_guard_could_not_count(stack: Stack) -> None:
    """RabbitMQ only: the consumer cannot count (as when Postgres is away), so the guard never
    dead-letters; the quorum queue does, after BROKER_LIMIT + 1 failed deliveries, into the inbox.
    The consumer records it (``by: broker``, RabbitMQ's reason) and moves it to ``dead_letter``."""
    env, records = poison(stack, "before_count")
    for record in records:
        assert (record["by"], record["broker_reason"]) == ("broker", "delivery_limit"), record
        assert record["deliveries"] == BROKER_LIMIT + 1 and record["from_queue"].startswith("actions")
    # Deliveries the guard saw but could not count: one per death, all of them.
    assert worker_log(stack).count("delivery not counted") >= BROKER_LIMIT + 1
    # The consumer logs after recording and moving: the line may trail the record by a moment.
    wait_for(lambda: "dead-lettered by the broker (delivery_limit)" in worker_log(stack), 10, what="the log line")
    assert stack.queued(INBOX) == []
    row = stack.wait_settled(env.action_id, timeout=90)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert stack.effects(env.idempotency_key) == 1


@pytest.mark.parametrize("stack", ["rabbitmq"], indirect=True)  # the broker's dead letters: RabbitMQ only
def test_a_failed_move_is_retried_without_a_second_record(stack: Stack) -> None:
    """The broker's dead letter is recorded, its move to ``dead_letter`` fails once, and it is
    requeued: the next delivery finds the record and only moves it. One record per message."""
    faultpoints.arm(stack.faultpoints, "before_dead_letter_move", remaining=1, action="raise")
    try:
        env, _ = poison(stack, "before_count")
    finally:
        faultpoints.arm(stack.faultpoints, "before_dead_letter_move", remaining=0)
    assert faultpoints.fired(stack.faultpoints, "before_dead_letter_move") == 1
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
    worker's main process receives, runs and settles an action. Had the recorder slept instead, the
    action could not even be received before the wait ended, and the message would be recorded then."""
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
        row = stack.wait_settled(env.action_id, timeout=RECORD_RETRY)
        assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
        assert records_of_message(stack, "task:" + task_id) == []  # still waiting, unacknowledged
    finally:
        faultpoints.arm(stack.faultpoints, "before_dead_letter_record", remaining=0)
    assert "broker dead-letter not recorded; requeued" in worker_log(stack)
    records = wait_for(lambda: records_of_message(stack, "task:" + task_id), RECORD_RETRY + 30,
                       what="the dead letter recorded after its requeue")
    assert len(records) == 1 and records[0]["by"] == "broker", records
    wait_for(lambda: task_id in stack.queued("dead_letter"), 30, what="the message in dead_letter")
    assert stack.queued(INBOX) == []
