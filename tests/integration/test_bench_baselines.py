"""The cost benchmark's bare-Celery baselines (``ops/baseline_tasks.py``) against a stack's own
sandboxed stdio server.

The bench's ratios are only as good as its baselines: the two-call baseline resolved the servers
file's relative paths against the checkout's ``var`` folder instead of the file's own, so over
stdio its sandboxed reader could not open the store and every bare task reported failure (the
bench then refused its own run). Each task body runs here in this process, as a pool process of the
baseline worker would run it, with the stack's settings; the completion record goes to the stack's
own Redis database.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from ops import baseline_tasks
from proofline.settings import get_settings
from proofline_kit.stack import Stack, redis_client
from proofline_kit.witness.placement import READ_SUFFIX
from worker.mcp_client import close_sessions


@pytest.fixture
def as_baseline_worker(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    """This process configured as the stack's baseline worker: its settings, its servers file, its
    Redis for the completion list; the process's sessions closed before and after."""
    for name, value in stack.env.items():
        if name.startswith(("PROOFLINE_", "SOR_", "AUDIT_")):
            monkeypatch.setenv(name, value)
    client = redis_client(stack)
    monkeypatch.setattr(baseline_tasks, "_done_list", lambda: client)
    close_sessions()
    get_settings.cache_clear()
    try:
        yield stack
    finally:
        close_sessions()
        get_settings.cache_clear()
        client.delete(baseline_tasks.DONE_KEY)
        client.close()


def done_records(stack: Stack) -> list[list]:
    client = redis_client(stack)
    try:
        return [json.loads(raw) for raw in client.lrange(baseline_tasks.DONE_KEY, 0, -1)]
    finally:
        client.close()


def test_the_two_call_baseline_writes_and_reads_back_through_the_sandboxed_server(as_baseline_worker: Stack) -> None:
    stack = as_baseline_worker
    key = f"bare-test-{time.monotonic_ns()}"
    ok = baseline_tasks.bare.run(1, key, {"tenant": "acme", "title": "bare baseline", "owner": "ops"}, time.time())
    assert ok is True, done_records(stack)
    assert stack.effects(key) == 1  # the write reached the stack's own store, once
    [(index, _, _, recorded_ok)] = done_records(stack)
    assert (index, recorded_ok) == (1, True)


def test_the_same_calls_baseline_makes_the_runtimes_requests_and_they_answer(as_baseline_worker: Stack) -> None:
    stack = as_baseline_worker
    assert stack.witness is not None
    env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": "bare same calls", "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"})
    since = stack.witness.mark()
    ok = baseline_tasks.bare_same.run(2, "ticket.create", env.model_dump(mode="json"), time.time())
    assert ok is True, done_records(stack)
    assert stack.effects(env.idempotency_key) == 1
    # The write went to the writer once, with the envelope's key; the reads answered without error
    # (``ok``), the verification read through the read identity.
    assert stack.witness.count(tool="create_ticket", key=env.idempotency_key, server="sor", since=since) == 1
    assert stack.witness.count(tool="find_ticket_by_key", server="sor" + READ_SUFFIX, since=since) >= 1
