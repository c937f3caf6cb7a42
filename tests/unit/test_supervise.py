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


class Hooks:
    """Records what the supervisor tells it; fails on the first end when told to."""

    def __init__(self, fail_first: bool = False) -> None:
        self.ends: list[int] = []
        self.fail_first = fail_first

    def env(self) -> dict[str, str]:
        return {"PROOFLINE_TEST_RUN": str(len(self.ends))}

    def ended(self, code: int) -> None:
        self.ends.append(code)
        if self.fail_first and len(self.ends) == 1:
            raise RuntimeError("a hook that breaks")


def test_hooks_see_each_run_and_a_failing_hook_never_stops_a_restart(tmp_path: Path) -> None:
    # The child reads the environment the hook gave it: run 0 is killed, run 1 exits cleanly.
    script = ("import os, signal, time; time.sleep(0.3); "
              "os.kill(os.getpid(), signal.SIGKILL) if os.environ['PROOFLINE_TEST_RUN'] == '0' else None")
    hooks = Hooks(fail_first=True)
    code = supervise([sys.executable, "-c", script], backoff_seconds=0.01, early_exit_seconds=0.1, hooks=hooks)
    assert code == 0
    assert hooks.ends == [-signal.SIGKILL, 0]
