"""The bench's baselines: bare Celery tasks with no durability.

- ``bench.bare``: the same two MCP calls as a ``ticket.create`` action (one ``create_ticket``
  write, one ``find_ticket_by_key`` read), the first baseline.
- ``bench.bare_same``: the MCP requests the runtime makes for one action of any contract, in its
  order: the precondition read and the write through the write identity, the verification read
  through the read identity, with arguments built from the contract as the runtime builds them.
  No tool list, no conditions judged, no ledger.

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
from typing import Any

import redis
from celery import Celery, signals

from proofline.settings import Settings, get_settings
from worker import calls
from worker.mcp_client import close_sessions, sessions
from worker.servers import Server, server_named

TASK = "bench.bare"
SAME_CALLS_TASK = "bench.bare_same"
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


def _server(settings: Settings) -> Server:
    return server_named(settings.servers_file, os.environ.get("BENCH_SERVER", "sor"))


@signals.worker_process_shutdown.connect
def _close(**_: Any) -> None:
    close_sessions()


@app.task(name=TASK)
def bare(i: int, key: str, arguments: dict[str, Any], published_at: float) -> bool:
    """Write, then read back by key. Records completion; returns whether the ticket was found."""
    settings = get_settings()
    server = _server(settings)
    # Relative paths of the servers file (its cwd, its sandbox's paths) are the file's folder's, as
    # the runtime's sessions resolve them.
    mcp = sessions(settings.servers_base_dir, settings.environment)
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


@app.task(name=SAME_CALLS_TASK)
def bare_same(i: int, action_type: str, envelope: dict[str, Any], published_at: float) -> bool:
    """Precondition read, write, verification read for ``envelope`` (an envelope's JSON) against the
    server its contract names. Records completion; returns whether every request answered without error."""
    from proofline.conditions import build_arguments
    from proofline.contracts import contract_for, extract

    settings = get_settings()
    contract = contract_for(settings.contracts_dir, action_type)
    compiled = contract.compiled()
    server = server_named(settings.servers_file, contract.server)
    mcp = sessions(settings.servers_base_dir, settings.environment)
    variables = {"envelope": envelope, "args": envelope["arguments"], "target": envelope["target"]}
    deadline = time.monotonic() + contract.timeout_seconds
    ok = False
    try:
        path = contract.precondition_read
        before_args = build_arguments(path.arguments, variables, compiled)
        before = mcp.run(server, "write", lambda c: calls.read_tool(
            c, tool=path.tool, arguments=before_args, timeout_seconds=contract.timeout_seconds))
        result, _ = mcp.run(server, "write", lambda c: calls.call_tool(
            c, tool=contract.tool, arguments=envelope["arguments"], idempotency_key=envelope["idempotency_key"],
            action_id=envelope["action_id"], timeout_seconds=contract.timeout_seconds,
            deadline_monotonic=deadline, progress=calls.ProgressLog(limit=20)))
        values = {} if getattr(result, "is_error", False) else extract(result, contract.result)
        read = contract.verification_read
        after_args = build_arguments(read.arguments, {**variables, "before": {}, "result": values}, compiled)
        after = mcp.run(server, "read", lambda c: calls.read_tool(
            c, tool=read.tool, arguments=after_args, timeout_seconds=contract.timeout_seconds))
        ok = not any(getattr(r, "is_error", False) for r in (before, result, after))
    finally:
        _done_list().rpush(DONE_KEY, json.dumps([i, published_at, time.time(), ok]))
    return ok
