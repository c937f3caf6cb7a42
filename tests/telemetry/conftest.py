"""One deployment for the telemetry tests: two supervised workers (two prefork processes each),
each serving its own metrics endpoint, logging JSON to its log file."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import Stack, build_stack, free_port, start_workers, teardown_stack


@dataclass
class Observed:
    stack: Stack
    #: Each worker's metrics port.
    ports: list[int]
    #: Each worker's log file.
    logs: list[Path]


@pytest.fixture(scope="package")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    stack = build_stack("stdio", tmp_path_factory.mktemp("observed"))
    ports = [free_port(), free_port()]
    try:
        for i, port in enumerate(ports):
            env = {**stack.env, "PROOFLINE_METRICS_PORT": str(port), "PROOFLINE_LOG_FORMAT": "json",
                   "PROMETHEUS_MULTIPROC_DIR": str(stack.workdir / f"metrics-{i}")}
            start_workers(stack, name=f"o{i}", beat=i == 0, env=env)
        yield Observed(stack, ports, [stack.workdir / f"worker-o{i}0.log" for i in range(len(ports))])
    finally:
        teardown_stack(stack)
