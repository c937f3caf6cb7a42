"""What a supervised worker run costs to start: a new interpreter against a fork of the supervisor.

``python -m ops.worker_start_bench [--rounds 5]`` starts Celery's ``report`` command for the
worker's app (it imports ``worker.tasks``, builds the app and its configuration, prints them and
exits: a worker's start up to its consumer, without a broker) in two ways, alternately, in one run:

- **exec** (the baseline): ``python -m celery -A worker.tasks report``, a new interpreter, as the
  supervisor started every run until 2026-12-06;
- **fork**: a fork of this process after it imported ``worker/preload.py``'s ``LIBRARIES``, calling
  ``celery.__main__.main`` (what ``proofline worker``'s supervisor does now,
  ``proofline/supervise.py``).

It reports the CPU-seconds and wall seconds of each (the child's own, from ``wait4``), and fork as a
ratio of exec. The preload's own cost is paid once per supervisor and is printed apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from proofline.supervise import ForkedRun


def _exec_run() -> tuple[float, float]:
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.execv(sys.executable, [sys.executable, "-m", "celery", "-A", "worker.tasks", "report"])
    _, status, usage = os.wait4(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    return usage.ru_utime + usage.ru_stime, time.monotonic() - started


def _report() -> None:
    import celery.__main__

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    sys.argv = [celery.__main__.__file__, "-A", "worker.tasks", "report"]
    celery.__main__.main()


def _fork_run() -> tuple[float, float]:
    started = time.monotonic()
    run = ForkedRun(_report, ["celery"], {})
    _, status, usage = os.wait4(run.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    return usage.ru_utime + usage.ru_stime, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    before = time.process_time()
    from worker import preload

    missing = preload.modules(preload.LIBRARIES)
    preload_cpu = time.process_time() - before
    results: dict[str, list[tuple[float, float]]] = {"exec": [], "fork": []}
    for _ in range(args.rounds):
        results["exec"].append(_exec_run())
        results["fork"].append(_fork_run())
    base_cpu = statistics.median(c for c, _ in results["exec"])
    base_wall = statistics.median(w for _, w in results["exec"])
    print(f"supervisor's preload (once per supervisor): {preload_cpu:.2f} CPU-s"
          + (f" (not importable here: {', '.join(missing)})" if missing else ""))
    print(f"{'start':6} {'CPU-s (median)':>15} {'wall s (median)':>16} {'CPU ratio':>10} {'wall ratio':>11}")
    for name, runs in results.items():
        cpu = statistics.median(c for c, _ in runs)
        wall = statistics.median(w for _, w in runs)
        print(f"{name:6} {cpu:15.3f} {wall:16.3f} {cpu / base_cpu:10.2f} {wall / base_wall:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
