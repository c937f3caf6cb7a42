"""Hostile and broken messages on the real broker, handled by real supervised Celery workers.

Every one must end as a recorded outcome (a refusal on its own chain, a dead-letter record, a
closed action), never as a dropped message, a consumer crash or a restarted worker.
"""

from __future__ import annotations

import json
import pickle
import shutil
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis
import yaml

from ledger.states import ActionStatus, Outcome
from proofline.errors import MalformedEnvelope
from tests.conftest import ROOT, Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.containment.helpers import (
    celery_main_pid,
    deep_body,
    push,
    wait_refusal,
    worker_log,
    worker_starts,
)
from tests.helpers import LosingBroker, evidence_of, ticket_env, uid
from worker import faultpoints, wire
from worker.validate import MAX_MESSAGE_BYTES


def _contracts(tmp: Path) -> Path:
    """The repository's contracts, except that ticket.close's authoritative read cannot be parsed."""
    target = tmp / "contracts"
    shutil.copytree(ROOT / "contracts", target)
    path = target / "ticket.close.yaml"
    data = yaml.safe_load(path.read_text())
    data["precondition_read"]["extract"] = {"mode": "pattern", "pattern": r"^(?P<never>this text never comes)$"}
    path.write_text(yaml.safe_dump(data))
    return target


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("containment")
    s = build_stack("stdio", tmp, extra_env={
        "PROOFLINE_CONTRACTS_DIR": str(_contracts(tmp)), "PROOFLINE_MAX_UNSETTLED_DELIVERIES": "3",
        "PROOFLINE_DEADLINE_GRACE_SECONDS": "2", "PROOFLINE_TASK_RETRY_LIMIT": "8"})
    try:
        start_workers(s)
        yield s
    finally:
        faultpoints.arm(s.faultpoints, "on_delivery", remaining=0)
        teardown_stack(s)


def good_action_settles(stack: Stack, timeout: float = 30.0) -> None:
    env = ticket_env(stack)
    stack.publish(env)
    row = stack.wait_settled(env.action_id, timeout=timeout)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row


def test_940_deep_message_is_refused_and_the_worker_keeps_serving(stack: Stack) -> None:
    main_pid, starts = celery_main_pid(stack), worker_starts(stack)
    task_id = push(stack, deep_body(940))
    evidence = wait_refusal(stack, task_id)
    assert evidence["reason_code"] == "message_too_deep"
    assert evidence["chain"] == "refused:" + wire.digest(deep_body(940))[:40]
    assert len(evidence["excerpt"]) <= wire.EXCERPT_CHARS
    good_action_settles(stack, timeout=20)
    # The consumer never died: same Celery process, no restart by the supervisor.
    assert celery_main_pid(stack) == main_pid
    assert worker_starts(stack) == starts == 1
    assert stack.workers_alive()


@pytest.mark.parametrize("content_type, body", [
    ("application/x-python-serialize", pickle.dumps((["x"], {}, {}))),
    ("application/json", json.dumps([[{"envelope": {}}], {}, {}])),
    ("application/json", deep_body(940)),
    ("application/data", b"raw bytes kombu trusts without an accept list"),
    ("text/plain", b"\xff\xfe not utf-8"),
])
def test_other_content_types_are_refused_with_a_record(stack: Stack, content_type: str, body: bytes | str) -> None:
    main_pid = celery_main_pid(stack)
    task_id = push(stack, body, content_type=content_type, content_encoding="binary")
    evidence = wait_refusal(stack, task_id)
    assert evidence["reason_code"] in {"message_content_type_refused", "message_malformed"}, evidence
    assert evidence["by"] == "consumer"
    assert celery_main_pid(stack) == main_pid and worker_starts(stack) == 1


def test_malformed_headers_and_unknown_tasks_are_recorded(stack: Stack) -> None:
    unknown = push(stack, wire.dumps([[], {}, {}]), task="proofline.no_such_task")
    assert wait_refusal(stack, unknown)["reason_code"] == "message_unknown_task"
    nested: object = []
    for _ in range(500):
        nested = [nested]
    deep_header = push(stack, wire.dumps([[], {}, {}]), headers={"x": nested})
    # Too deep for kombu's own document: quarantined by the transport, refused under its task id.
    assert wait_refusal(stack, deep_header)["reason_code"] == "message_undecodable"
    nested = []
    for _ in range(40):
        nested = [nested]
    deep_header = push(stack, wire.dumps([[], {}, {}]), headers={"x": nested})
    assert wait_refusal(stack, deep_header)["reason_code"] == "message_malformed"
    # An ETA a year away would sit in the worker's memory; a garbled one is Celery's to refuse.
    far = push(stack, wire.dumps([[], {}, {}]), headers={"eta": "2099-01-01T00:00:00+00:00"})
    assert wait_refusal(stack, far)["reason_code"] == "message_malformed"
    garbled = push(stack, wire.dumps([[], {}, {}]), headers={"eta": "soon"})
    assert wait_refusal(stack, garbled)["reason_code"] == "message_malformed"
    # Arguments that do not fit the task: recorded by the task, never run.
    misfit = push(stack, wire.dumps([["a", "b", "c"], {"nope": 1}, {}]), task="proofline.verify")
    assert wait_refusal(stack, misfit)["reason_code"] == "message_malformed"
    good_action_settles(stack)
    assert worker_starts(stack) == 1


def test_oversize_and_undecodable_bodies(stack: Stack) -> None:
    big = wire.dumps([[{"envelope": {"blob": "x" * (wire.MAX_BODY_BYTES + 1)}}], {}, {}])
    assert wait_refusal(stack, push(stack, big))["reason_code"] == "message_too_large"
    assert wait_refusal(stack, push(stack, b"\xff\xfe\x00garbage", content_encoding="binary"))["reason_code"] \
        == "message_undecodable"
    assert wait_refusal(stack, push(stack, b"[[1],{}"))["reason_code"] == "message_undecodable"
    assert wait_refusal(stack, push(stack, b'{"args": []}'))["reason_code"] == "message_malformed"
    assert worker_starts(stack) == 1


def test_lone_surrogates_and_nul_are_refused_with_a_writable_record(stack: Stack) -> None:
    message = stack.message(ticket_env(stack))
    message["envelope"]["tenant"] = "acme\ud800"
    message["envelope"]["action_id"] = "act-\udcff\x00-" + uid()
    task_id = push(stack, wire.dumps([[message], {}, {}]))
    evidence = wait_refusal(stack, task_id)
    assert evidence["reason_code"] in {"envelope_malformed", "envelope_bad_signature"}, evidence
    assert "\\x00" in evidence["claimed"]["action_id"] and "\\udcff" in evidence["claimed"]["action_id"]
    # An integer too long for Python to parse: a decode error, refused all the same.
    huge = b'[[{"envelope": {"n": 1' + b"0" * 5000 + b'}}],{},{}]'
    assert wait_refusal(stack, push(stack, huge))["reason_code"] == "message_undecodable"


def test_a_message_that_crashes_its_process_is_dead_lettered_then_expired(stack: Stack) -> None:
    """Each delivery ends its pool process; after three, the consumer moves it to ``dead_letter``
    with a record. The reconciler's re-sends die the same way until the deadline passes, and then
    the action is closed with the evidence of what was tried, never left published."""
    env = ticket_env(stack, deadline_in=timedelta(seconds=12))
    faultpoints.arm(stack.faultpoints, "on_delivery", remaining=1000, action="crash", action_id=env.action_id)
    try:
        published = stack.publish(env)
        dead = wait_for(lambda: refusal_for_task(stack, published["task_id"]), 60, what="a dead_lettered record")
        assert dead["deliveries"] == 4 and dead["unsettled"] == 4 and dead["queue"] == "dead_letter"
        assert dead["claimed"]["action_id"] == env.action_id
        queued = redis.Redis.from_url(stack.broker_url).lrange("dead_letter", 0, -1)
        assert any(published["task_id"] in item.decode() for item in queued)
        # The consumer logs after recording: the line may trail the record by a moment.
        wait_for(lambda: "dead-lettered after 4 deliveries" in worker_log(stack), 10, what="the dead-letter log line")
        row = stack.wait_settled(env.action_id, timeout=60)
    finally:
        faultpoints.arm(stack.faultpoints, "on_delivery", remaining=0)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.not_started,
                                                          "deadline_expired_unexecuted")
    expired = [e["evidence"] for e in stack.timeline(env.action_id) if e["event"] == "deadline_expired_unexecuted"]
    assert len(expired) == 1
    assert expired[0]["deliveries"]["deliveries"] >= 4 and expired[0]["deliveries"]["dead_lettered"] is True
    assert expired[0]["last_refusal"]["event"] == "dead_lettered"
    assert stack.effects(env.idempotency_key) == 0
    assert "action expired unexecuted" in worker_log(stack)
    good_action_settles(stack)


def refusal_for_task(stack: Stack, task_id: str) -> dict | None:
    with stack.conn.cursor() as cur:
        cur.execute("SELECT evidence FROM ledger_events WHERE event = 'dead_lettered' AND "
                    "evidence->>'message_key' = %s", ("task:" + task_id,))
        row = cur.fetchone()
    return row["evidence"] if row else None


# --- the four bugs that left actions published or lost their cause ------------------------------


def test_unparseable_read_is_a_recorded_target_read_failed(stack: Stack) -> None:
    """Regression: extraction of the authoritative read ran outside the read's error handling, so
    Celery retried an unexpected error and the action closed as ``deadline_passed`` with the real
    cause nowhere in the ledger."""
    from proofline_kit.sor import store as sor

    ticket = sor.put_ticket(stack.sor_db, "acme", "to close", "ops")
    version = sor.get_ticket(stack.sor_db, ticket)["ticket"]["version"]
    env = stack.envelope("ticket.close", arguments={"ticket_id": ticket, "expected_version": version},
                         target={"type": "ticket", "id": ticket, "expected_version": version},
                         deadline_in=timedelta(seconds=8), retry_policy={"backoff_seconds": 0.5})
    stack.publish(env)
    row = stack.wait_settled(env.action_id, timeout=40)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.failed_before_side_effect,
                                                          "target_read_failed")
    failures = [e["evidence"] for e in stack.timeline(env.action_id) if e["event"] == "precheck_unavailable"]
    assert failures and all(f["reason_code"] == "target_read_failed" for f in failures)
    assert "cannot read" in failures[-1]["detail"]
    assert "execute failed; retrying" not in worker_log(stack)


def test_publish_refuses_what_every_worker_would_refuse(stack: Stack) -> None:
    """Regression: a 5 MB argument was recorded ``published``, refused on every delivery and
    re-sent forever. Publication now runs the worker's validation first and records nothing."""
    env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": "x" * (5 * 1024 * 1024),
                                                     "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"})
    with pytest.raises(MalformedEnvelope) as refused:
        stack.publish(env)
    assert str(MAX_MESSAGE_BYTES) in refused.value.detail
    assert stack.action(env.action_id) is None and stack.events(env.action_id) == []
    with stack.conn.cursor() as cur:
        cur.execute("SELECT evidence FROM ledger_events WHERE event = 'publish_refused' AND "
                    "evidence->'claimed'->>'action_id' = %s", (env.action_id,))
        assert cur.fetchone()["evidence"]["reason_code"] == "envelope_malformed"


def test_nul_in_a_signed_argument_survives_storage_and_redrive(stack: Stack) -> None:
    """Regression: jsonb rewrote a NUL as the text ``\\u0000``, so the stored signed message no
    longer matched its signature and every re-send after a lost broker message was refused."""
    from proofline.canonical import canonical_bytes
    from proofline.controller import publish_message

    env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": f"nul\x00{uid()}", "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"})
    message = stack.message(env)
    publish_message(stack.conn, LosingBroker(), message, env, settings=stack.settings)
    stored = stack.action(env.action_id)
    assert stored is not None and stored.signed_message == message  # a NUL again, not six characters
    assert canonical_bytes(stored.signed_message) == canonical_bytes(message)
    # The broker lost it; the reconciler re-sends the stored message and the worker accepts its
    # signature and executes it (what happens after the call is verification's business).
    wait_for(lambda: "tool_called" in stack.events(env.action_id), 40, what="the re-sent action to execute")
    validated = [e["evidence"] for e in stack.timeline(env.action_id) if e["event"] == "validated"]
    assert validated and validated[0]["arguments_hash"] == env.arguments_hash
    assert stack.effects(env.idempotency_key) == 1
    assert refusal_for_claimed(stack, env.action_id) is None


def refusal_for_claimed(stack: Stack, action_id: str) -> dict | None:
    with stack.conn.cursor() as cur:
        cur.execute("SELECT evidence FROM ledger_events WHERE event = 'envelope_refused' AND "
                    "evidence->'claimed'->>'action_id' = %s", (action_id,))
        row = cur.fetchone()
    return row["evidence"] if row else None


def test_a_read_outage_is_retried_past_three_and_the_envelope_never_logged(stack: Stack) -> None:
    """Regression: ``self.retry(max_retries=None)`` means the task default (3), so during a read
    outage the task gave up after three retries with ``MaxRetriesExceededError`` and the whole
    envelope in an ERROR traceback."""
    from proofline_kit.sor import store as sor

    marker = f"marker-{uuid.uuid4().hex}"
    env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": marker, "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"}, retry_policy={"backoff_seconds": 0.2})
    sor.set_read_outage(stack.sor_db, True)
    try:
        published = stack.publish(env)

        # Repeats of one cause are counted, not recorded (worker/read_waits.py): the count names
        # the delivery and its attempt that counted last.
        def retries() -> int:
            wait = (stack.action(env.action_id).recovery_data or {}).get("read_failures") or {}
            return int(wait.get("attempt", 0)) - 1

        wait_for(lambda: retries() >= 6, 40, what="six retries of one delivery")
        assert published["task_id"]
    finally:
        sor.set_read_outage(stack.sor_db, False)
    row = stack.wait_settled(env.action_id, timeout=40)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row
    log = worker_log(stack)
    assert "MaxRetriesExceeded" not in log
    assert marker not in log


def test_a_delivery_past_its_retry_limit_is_recorded_and_the_action_redriven(stack: Stack) -> None:
    """Past the explicit limit (8 here) the delivery ends with a ``delivery_abandoned`` record
    instead of Celery's MaxRetriesExceededError; the ledger still says published, so the reconciler
    re-sends it and it executes once the outage is over."""
    from proofline_kit.sor import store as sor

    marker = f"marker-{uuid.uuid4().hex}"
    env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": marker, "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"}, retry_policy={"backoff_seconds": 0.1})
    sor.set_read_outage(stack.sor_db, True)
    try:
        published = stack.publish(env)
        # The reconciler re-sends the still-published action while its first delivery retries, and
        # whichever copy finds the target's lock taken steps aside (lease_busy): the record may be
        # any copy's, each on its own delivery chain, naming the action it claimed.
        abandoned = wait_for(lambda: abandoned_delivery(stack, env.action_id), 60,
                             what="an abandoned delivery's record")
    finally:
        sor.set_read_outage(stack.sor_db, False)
    assert abandoned["chain"].startswith("delivery:") and published["task_id"]
    abandoned = abandoned["evidence"]
    assert abandoned["retries"] == 8 and abandoned["claimed"]["action_id"] == env.action_id
    assert "RetryLater" in abandoned["error"]
    row = stack.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row
    assert stack.effects(env.idempotency_key) == 1
    log = worker_log(stack)
    assert "MaxRetriesExceeded" not in log and marker not in log


def abandoned_delivery(stack: Stack, action_id: str) -> dict | None:
    """The first ``delivery_abandoned`` record of any delivery that claimed ``action_id``."""
    with stack.conn.cursor() as cur:
        cur.execute("SELECT action_id AS chain, evidence FROM ledger_events WHERE event = 'delivery_abandoned' "
                    "AND evidence->'claimed'->>'action_id' = %s ORDER BY id LIMIT 1", (action_id,))
        return cur.fetchone()


def test_documents_kombu_cannot_read_are_recorded_not_fatal(stack: Stack) -> None:
    """Anyone who can write to Redis can push a document that is not kombu's JSON; kombu parsed it
    in the consumer's event loop after it had left Redis, and the worker died."""
    main_pid = celery_main_pid(stack)
    client = redis.Redis.from_url(stack.broker_url)
    docs = [b"not json at all \xff", b'{"body": "x"}', b"[" * 5000 + b"]" * 5000,
            json.dumps({"body": "!!", "properties": {"delivery_tag": "t", "body_encoding": "base64"}}).encode()]
    for doc in docs:
        client.lpush("actions", doc)
    for doc in docs:
        chain = wait_for(lambda d=doc: broker_refusal(stack, d), 20, what=f"a record of {doc[:30]!r}")
        assert chain["reason_code"] == "message_undecodable"
    good_action_settles(stack)
    assert celery_main_pid(stack) == main_pid and worker_starts(stack) == 1


def broker_refusal(stack: Stack, doc: bytes) -> dict | None:
    from worker.transport import QUARANTINE_PREFIX

    digest = wire.digest(QUARANTINE_PREFIX + doc)
    with stack.conn.cursor() as cur:
        cur.execute("SELECT evidence FROM ledger_events WHERE event = 'envelope_refused' AND "
                    "evidence->>'message_digest' = %s", (digest,))
        row = cur.fetchone()
    return row["evidence"] if row else None


# --- reads that fail keep failing cheaply (worker/read_waits.py) --------------------------------


def test_a_read_that_keeps_failing_backs_off_records_one_event_and_closes_as_documented(stack: Stack) -> None:
    """Regression: an unparseable precondition read was retried every ``backoff_seconds`` (fixed)
    for the whole deadline, three events each time (771 in ten minutes), and the action closed
    ``not_started / deadline_expired_unexecuted``. Now the wait doubles (with jitter), one event is
    stored per distinct cause with its count, and the worker closes the action
    ``failed_before_side_effect / target_read_failed`` when the next wait would pass the deadline."""
    from proofline_kit.sor import store as sor

    # This module's ticket.close contract cannot parse its precondition read (``_contracts``).
    ticket = sor.put_ticket(stack.sor_db, "acme", "to close", "ops")
    version = sor.get_ticket(stack.sor_db, ticket)["ticket"]["version"]
    env = stack.envelope("ticket.close", arguments={"ticket_id": ticket, "expected_version": version},
                         target={"type": "ticket", "id": ticket, "expected_version": version},
                         deadline_in=timedelta(seconds=30), timeout_seconds=3, retry_policy={"backoff_seconds": 1})
    start = stack.witness.mark()
    stack.publish(env)
    row = stack.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.failed_before_side_effect,
                                                          "target_read_failed"), row
    read_tool = yaml.safe_load((ROOT / "contracts" / "ticket.close.yaml").read_text())["precondition_read"]["tool"]
    reads = sorted(c.at for c in stack.witness.calls(tool=read_tool, since=start))
    # A fixed 1 s backoff reads some 15 times in 30 s, evenly; doubling from 1 s (whole-second
    # countdowns, the upper half drawn at random), 5 or 6 times, each wait longer.
    assert 4 <= len(reads) <= 7, reads
    gaps = [b - a for a, b in zip(reads, reads[1:], strict=False)]
    assert gaps[-1] >= 2 * gaps[0] and gaps[-1] >= 4, gaps
    waits = evidence_of(stack, env.action_id, "precheck_unavailable")
    assert len(waits) == 2, waits  # the cause's first failure, and the closing record
    first, closing = waits
    assert first["count"] == 1 and first["cause"] == closing["cause"] and "cannot read" in first["detail"]
    assert closing["count"] == len(reads)
    assert [(c["cause"], c["count"]) for c in closing["read_failures"]] == [(first["cause"], len(reads))]
    # Stored: the first failure's stages and the closing ones (a re-send by the reconciler while
    # the first delivery waited in a busy queue adds its own ``redriven`` / ``redelivery_ignored``).
    events = stack.events(env.action_id)
    assert events.count("validated") == 2 and events.count("revalidated") == 2, events
    assert "tool_called" not in stack.events(env.action_id) and stack.effects(env.idempotency_key) == 0


def test_a_five_megabyte_raw_message_is_refused_as_too_large_with_its_true_size(stack: Stack) -> None:
    """Regression: the Redis document was cut to the wire limit before it was read, so a 5 MB
    message was recorded ``message_undecodable`` with ``message_bytes: 278567``."""
    body = wire.dumps([[{"envelope": {"blob": "x" * (5 * 1024 * 1024)}}], {}, {}]).encode()
    task_id = push(stack, body)
    refusal = wait_refusal(stack, task_id, timeout=40)
    assert refusal["reason_code"] == "message_too_large", refusal
    # The document kombu stored holds the body base64-encoded: larger than the body itself.
    assert refusal["message_bytes"] > len(body) and str(refusal["message_bytes"]) in refusal["detail"]
    good_action_settles(stack)
    assert worker_starts(stack) == 1
