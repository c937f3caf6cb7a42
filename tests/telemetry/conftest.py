"""One deployment for the telemetry tests: two supervised workers (two prefork processes each),
each serving its own metrics endpoint, logging JSON to its log file and writing its spans to
files (OTEL_TRACES_EXPORTER=jsonl), reporting to a loopback Sentry receiver with tracing on."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import Stack, build_stack, free_port, start_workers, teardown_stack
from tests.security.test_secrets import SentryReceiver

#: The tenant the metrics label by name (the mixed batch's); others are "other".
NAMED_TENANT = "acme"
#: The release the workers report to Sentry.
RELEASE = f"proofline@telemetry-{os.getpid()}"


@dataclass
class Observed:
    stack: Stack
    #: Each worker's metrics port.
    ports: list[int]
    #: Each worker's log file.
    logs: list[Path]
    #: Where every process writes its finished spans (one JSON-lines file per process).
    traces: Path


@pytest.fixture(scope="package")
def sentry_receiver() -> Iterator[SentryReceiver]:
    receiver = SentryReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="package")
def observed(tmp_path_factory: pytest.TempPathFactory, sentry_receiver: SentryReceiver) -> Iterator[Observed]:
    stack = build_stack("stdio", tmp_path_factory.mktemp("observed"))
    # Metrics name this tenant; every other one is counted as tenant="other".
    stack.env["PROOFLINE_TELEMETRY_TENANTS"] = NAMED_TENANT
    ports = [free_port(), free_port()]
    traces = stack.workdir / "traces"
    try:
        for i, port in enumerate(ports):
            env = {**stack.env, "PROOFLINE_METRICS_PORT": str(port), "PROOFLINE_LOG_FORMAT": "json",
                   "PROMETHEUS_MULTIPROC_DIR": str(stack.workdir / f"metrics-{i}"),
                   "OTEL_TRACES_EXPORTER": "jsonl", "PROOFLINE_TRACES_DIR": str(traces),
                   "OTEL_BSP_SCHEDULE_DELAY": "200",
                   "PROOFLINE_SENTRY_DSN": sentry_receiver.dsn, "PROOFLINE_RELEASE": RELEASE,
                   "PROOFLINE_SENTRY_TRACES_SAMPLE_RATE": "1.0"}
            start_workers(stack, name=f"o{i}", beat=i == 0, env=env)
        yield Observed(stack, ports, [stack.workdir / f"worker-o{i}0.log" for i in range(len(ports))], traces)
    finally:
        teardown_stack(stack)
