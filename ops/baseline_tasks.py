"""The bench's baseline: a bare Celery task with no durability that makes the same two MCP calls
as a ``ticket.create`` action (one ``create_ticket`` write, one ``find_ticket_by_key`` read).

No ledger, no lease, no idempotency record, no verification task, no result backend. It reuses the
runtime's per-process MCP sessions (``worker.mcp_client.sessions``) and request coroutines
(``worker.calls``), so both sides pay the same client cost per call. Celery settings are the
library defaults (early ack, prefetch multiplier 4, no task events) apart from JSON only.

Run by ``ops.bench`` as its own worker::

    BENCH_BASELINE_BROKER=redis://127.0.0.1:6379/15 PROOFLINE_SERVERS_FILE=... \\
        python -m celery -A ops.baseline_tasks worker -Q bare -c 2 -P prefork

Each finished task appends ``[i, published_at, finished_at, ok]`` to the Redis list
``bench:done`` in the broker database: the bench counts completions and latencies from it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery, signals

from proofline.settings import ROOT
from worker import calls
from worker.mcp_client import close_sessions, sessions
from worker.servers import Server, server_named

TASK = "bench.bare"
QUEUE = "bare"
DONE_KEY = "bench:done"
TIMEOUT_SECONDS = 5.0

app = Celery("proofline-bench-baseline")
app.conf.update(
    broker_url=os.environ.get("BENCH_BASELINE_BROKER", "redis://127.0.0.1:6379/15"),
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    result_backend=None,
    task_default_queue=QUEUE,
)

_redis: redis.Redis | None = None
_redis_pid: int | None = None


def _done_list() -> redis.Redis:
    """One Redis client per pool child, made after fork."""
    global _redis, _redis_pid
    if _redis is None or _redis_pid != os.getpid():
        _redis = redis.Redis.from_url(app.conf.broker_url)
        _redis_pid = os.getpid()
    return _redis


def _server() -> Server:
    return server_named(Path(os.environ["PROOFLINE_SERVERS_FILE"]), os.environ.get("BENCH_SERVER", "sor"))


@signals.worker_process_shutdown.connect
def _close(**_: Any) -> None:
    close_sessions()


@app.task(name=TASK)
def bare(i: int, key: str, arguments: dict[str, Any], published_at: float) -> bool:
    """Write, then read back by key. Records completion; returns whether the ticket was found."""
    server = _server()
    mcp = sessions(ROOT / "var")
    progress = calls.ProgressLog(limit=20)
    deadline = time.monotonic() + TIMEOUT_SECONDS
    ok = False
    try:
        created, _ = mcp.run(server, "write", lambda c: calls.call_tool(
            c, tool="create_ticket", arguments=arguments, idempotency_key=key, action_id=f"bare-{i}",
            timeout_seconds=TIMEOUT_SECONDS, deadline_monotonic=deadline, progress=progress))
        found = mcp.run(server, "read", lambda c: calls.read_tool(
            c, tool="find_ticket_by_key", arguments={"idempotency_key": key}, timeout_seconds=TIMEOUT_SECONDS))
        content = getattr(found, "structured_content", None) or {}
        ok = not getattr(created, "is_error", False) and bool(content.get("found"))
    finally:
        _done_list().rpush(DONE_KEY, json.dumps([i, published_at, time.time(), ok]))
    return ok
