"""Serving metrics over HTTP: a worker's endpoint (its prefork pool's processes summed through
prometheus_client's multiprocess mode) and the ledger exporter's."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def prepare_multiprocess_dir() -> Path:
    """The directory the worker's processes write their metric files to, emptied: counters start
    at zero with the endpoint. ``PROMETHEUS_MULTIPROC_DIR`` names it, else a new temporary one.
    Set in this process's environment so that the Celery worker it starts (and its pool) inherit it."""
    chosen = os.environ.get(MULTIPROC_ENV)
    path = Path(chosen) if chosen else Path(tempfile.mkdtemp(prefix="proofline-metrics-"))
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    os.environ[MULTIPROC_ENV] = str(path)
    return path


def serve_worker_metrics(port: int, host: str) -> Any:
    """Serve the sum over every process that writes to the multiprocess directory (a thread of the
    calling process, which lives as long as the worker it supervises)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return start_http_server(port, addr=host, registry=registry)


def serve_registry(port: int, host: str, *collectors: Any) -> Any:
    """Serve only ``collectors`` (no process or platform metrics of the serving process)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return start_http_server(port, addr=host, registry=registry)
