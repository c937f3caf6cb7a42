"""The test kit's processes die with the test run that started them (proofline_kit/processes.py).

Every process a stack starts runs in its own session (so a test can stop it by process group); a
test run stopped by SIGTERM (a CI timeout, a developer's kill) must not leave the worker, beat, the
pool processes, the stdio servers and their tracers, or the brokers behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from proofline.settings import ROOT
from proofline_kit.processes import gone, stop_process, wait_for

HELD = Path(__file__).with_name("held_stack.py")


@pytest.mark.skipif(not Path("/usr/bin/strace").exists(), reason="strace is needed for the audited server")
def test_a_test_run_stopped_by_sigterm_leaves_none_of_its_processes(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    env = {**os.environ, "HELD_STACK_READY": str(ready)}
    with open(tmp_path / "pytest.log", "wb") as log:
        run = subprocess.Popen([sys.executable, "-m", "pytest", str(HELD), "-q", "-p", "no:cacheprovider",
                                "--basetemp", str(tmp_path / "base")], env=env, cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: ready.exists() or run.poll() is not None, 240, interval=0.5, what="the held stack")
        assert ready.exists(), (tmp_path / "pytest.log").read_text()[-3000:]
        held = psutil.Process(run.pid).children(recursive=True)
        names = {p.name() for p in held}
        # A positive control: the run holds the whole stack (worker, its pool, beat, the stdio server
        # under strace and bwrap, the system of record's processes).
        assert {"strace", "bwrap"} <= names, names
        assert sum("proofline" in " ".join(p.cmdline()) for p in held) >= 3, [p.cmdline() for p in held]
        run.send_signal(signal.SIGTERM)  # only the pytest process: what a CI timeout does
        run.wait(30)
        wait_for(lambda: all(gone(p) for p in held), 30,
                 what=f"the run's processes to die: {[p.pid for p in held if not gone(p)]}")
    finally:
        stop_process(run)
