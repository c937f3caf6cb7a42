"""The worker supervisor with real child processes: it stops on repeated early exits (a
configuration error restarted a hundred times helps nobody) and backs off exponentially otherwise."""

from __future__ import annotations

import json
import re
import signal
import subprocess
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


# Forked runs (``fork_main``): the same loop, each run a fork of the supervisor calling fork_main.
# The supervisor runs in a fresh interpreter of its own: a pytest process holds threads and sockets
# (xdist's channel, the stacks' clients), and a supervisor holding either never forks.

PROGRAM = """
import atexit, json, os, pathlib, signal, socket, sys, threading, time
from proofline.supervise import supervise

out = pathlib.Path(sys.argv[1])
atexit.register(lambda: out.with_suffix(".atexit").write_text(str(os.getpid())))


class Hooks:
    def __init__(self):
        self.ends = []

    def env(self):
        return {"PROOFLINE_TEST_RUN": str(len(self.ends))}

    def ended(self, code):
        self.ends.append(code)


def record(**fields):
    with out.open("a") as handle:
        handle.write(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), **fields}) + "\\n")
"""


def _supervisor(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    program = tmp_path / "supervisor.py"
    out = tmp_path / "runs.jsonl"
    program.write_text(PROGRAM + body)
    done = subprocess.run([sys.executable, str(program), str(out)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    runs = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return done, runs


def test_forked_runs_are_children_with_the_hooks_environment_and_their_exit_status(tmp_path: Path) -> None:
    # Run 0 is killed, run 1 fails with 5, run 2 exits cleanly; each lives past the early-exit bound.
    done, runs = _supervisor(tmp_path, """
def main():
    n = int(os.environ["PROOFLINE_TEST_RUN"])
    record(argv=sys.argv, n=n)
    time.sleep(0.3)
    if n == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(5 if n == 1 else 0)


hooks = Hooks()
code = supervise(["not-an-executable-a-fork-never-starts"], backoff_seconds=0.01, early_exit_seconds=0.1,
                 hooks=hooks, fork_main=main)
record(code=code, ends=hooks.ends, supervisor=True)
""")
    assert done.returncode == 0, done.stderr
    *children, supervisor = runs
    assert supervisor["code"] == 0 and supervisor["ends"] == [-signal.SIGKILL, 5, 0]
    assert [c["n"] for c in children] == [0, 1, 2]
    assert {c["ppid"] for c in children} == {supervisor["pid"]}
    assert len({c["pid"] for c in children} | {supervisor["pid"]}) == 4
    assert children[0]["argv"] == ["not-an-executable-a-fork-never-starts"]
    # The supervisor's own exit function ran once, in the supervisor, never in a run.
    assert (tmp_path / "runs.atexit").read_text() == str(supervisor["pid"])
    assert done.stderr.count("worker started") == 3


def test_a_stop_signal_reaches_the_forked_run(tmp_path: Path) -> None:
    done, runs = _supervisor(tmp_path, """
def main():
    record(started=True)
    time.sleep(60)


stopper = os.fork()
if stopper == 0:  # another process (a thread would stop the fork) stops the supervisor once the run has started
    while not out.exists():
        time.sleep(0.05)
    os.kill(os.getppid(), signal.SIGTERM)
    os._exit(0)
code = supervise(["not-an-executable-a-fork-never-starts"], fork_main=main)
record(code=code, supervisor=True)
""")
    assert done.returncode == 0, done.stderr
    child, supervisor = runs
    assert supervisor["code"] == -signal.SIGTERM
    assert child["ppid"] == supervisor["pid"] != child["pid"]


def test_a_supervisor_holding_a_thread_or_a_socket_starts_argv_instead(tmp_path: Path) -> None:
    done, runs = _supervisor(tmp_path, """
argv = [sys.executable, "-c", "import json, os; print(json.dumps({'how': 'argv', 'ppid': os.getppid()}))"]


def main():
    record(how="fork")


supervise(argv, fork_main=main)
release = threading.Event()
holder = threading.Thread(target=release.wait)
holder.start()
supervise(argv, fork_main=main)
release.set()
holder.join()
with socket.socket() as held:
    supervise(argv, fork_main=main)
supervise(argv, fork_main=main)
""")
    assert done.returncode == 0, done.stderr
    assert [r["how"] for r in runs] == ["fork", "fork"]
    assert done.stdout.count('"how": "argv"') == 2  # the thread's run and the socket's run
