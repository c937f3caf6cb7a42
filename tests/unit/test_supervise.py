"""The worker supervisor with real child processes: it stops on repeated early exits (a
configuration error restarted a hundred times helps nobody) and backs off exponentially otherwise."""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from proofline.supervise import supervise


@pytest.fixture(autouse=True)
def _restore_signals() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_repeated_early_exits_stop_the_supervisor_with_the_exit_code(capfd: pytest.CaptureFixture[str]) -> None:
    code = supervise([sys.executable, "-c", "import sys; sys.exit(3)"], backoff_seconds=0.01)
    err = capfd.readouterr().err
    assert code == 3
    assert len(re.findall(r"worker started", err)) == 3  # not 100
    assert "configuration or environment error" in err


def test_late_exits_are_restarted_with_exponential_backoff(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    # Each run lives past the early-exit bound and fails, until the fourth, which exits cleanly.
    script = (f"import pathlib, sys, time; p = pathlib.Path({str(runs)!r}); n = len(p.read_text()) if p.exists() "
              "else 0; p.write_text('x' * (n + 1)); time.sleep(0.3); sys.exit(0 if n == 3 else 1)")
    code = supervise([sys.executable, "-c", script], backoff_seconds=0.05, early_exit_seconds=0.2)
    err = capfd.readouterr().err
    assert code == 0
    delays = [float(d) for d in re.findall(r"restarting in ([0-9.]+) s", err)]
    assert delays == [0.05, 0.1, 0.2]


def test_a_run_of_early_exits_is_broken_by_a_healthy_run(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    # early, early, late, early, early, then clean: never three early exits in a row.
    script = (f"import pathlib, sys, time; p = pathlib.Path({str(runs)!r}); n = len(p.read_text()) if p.exists() "
              "else 0; p.write_text('x' * (n + 1)); time.sleep(0.3 if n == 2 else 0); sys.exit(0 if n == 5 else 2)")
    code = supervise([sys.executable, "-c", script], backoff_seconds=0.01, early_exit_seconds=0.25)
    err = capfd.readouterr().err
    assert code == 0
    assert len(re.findall(r"worker started", err)) == 6
