"""Telemetry wiring of a worker process: ledger-event counters, task CPU, and the action context
that log lines and counters read."""

from __future__ import annotations

import time
from typing import Any

from celery import signals

from proofline.settings import get_settings
from proofline.telemetry import context, metrics, observe, tracing

_started: dict[str, float] = {}


def install() -> None:
    """Count committed ledger events in this process (worker/tasks.py calls it at import)."""
    observe.install(metrics.LedgerEventMetrics())


@signals.worker_process_init.connect
def _start_tracing(**_: Any) -> None:
    """Each pool process starts its own tracer after the fork (exporter threads do not survive one)."""
    settings = get_settings()
    tracing.setup("proofline-worker", settings.environment, settings.release)


@signals.worker_process_shutdown.connect
def _stop_tracing(**_: Any) -> None:
    tracing.shutdown()  # flushes batched spans


@signals.task_prerun.connect
def _task_started(task_id: str | None = None, **_: Any) -> None:
    context.clear()  # a pool process runs many tasks: nothing of the last one's action carries over
    if task_id is not None:
        _started[task_id] = time.process_time()


@signals.task_postrun.connect
def _task_finished(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    began = _started.pop(task_id, None) if task_id is not None else None
    if began is None or task is None:
        return
    name = str(getattr(task, "name", "other")).removeprefix("proofline.")
    # A prefork pool process runs one task at a time: its CPU time in between is this task's.
    metrics.TASK_CPU_SECONDS.labels(name).inc(max(time.process_time() - began, 0.0))
    metrics.TASKS.labels(name).inc()
