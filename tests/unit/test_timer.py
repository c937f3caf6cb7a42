"""The process timer thread that runs lease heartbeats and session keepers (worker/timer.py)."""

from __future__ import annotations

import multiprocessing
import threading
import time

from worker import timer


def _wait_for(predicate, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_a_job_runs_every_interval_until_stopped() -> None:
    runs: list[float] = []
    job = timer.every(0.02, lambda: runs.append(time.monotonic()), name="count")
    assert _wait_for(lambda: len(runs) >= 3)
    job.stop()
    seen = len(runs)
    time.sleep(0.1)
    assert len(runs) == seen, "a stopped job ran again"


def test_a_job_is_not_run_before_its_interval() -> None:
    runs: list[int] = []
    job = timer.every(30.0, lambda: runs.append(1), name="slow")
    time.sleep(0.05)
    job.stop()
    assert runs == []


def test_stop_waits_for_a_run_in_progress() -> None:
    entered, release = threading.Event(), threading.Event()
    finished: list[bool] = []

    def slow() -> None:
        entered.set()
        release.wait(5)
        finished.append(True)

    job = timer.every(0.01, slow, name="slow-run")
    assert entered.wait(5)
    threading.Timer(0.1, release.set).start()
    assert job.stop(timeout=5)
    assert finished == [True], "stop returned while the job was still running"


def test_stop_reports_a_run_that_outlasts_its_timeout() -> None:
    entered, release = threading.Event(), threading.Event()
    job = timer.every(0.01, lambda: (entered.set(), release.wait(5)), name="stuck")
    assert entered.wait(5)
    assert job.stop(timeout=0.05) is False
    release.set()


def test_a_job_returning_false_is_not_run_again_and_others_go_on() -> None:
    once: list[int] = []
    other: list[int] = []
    first = timer.every(0.01, lambda: once.append(1) or False, name="once")
    second = timer.every(0.01, lambda: other.append(1), name="other")
    assert _wait_for(lambda: len(other) >= 5)
    assert once == [1]
    first.stop()
    second.stop()


def test_a_failing_job_is_dropped_without_stopping_the_thread() -> None:
    def boom() -> None:
        raise RuntimeError("boom")

    failing = timer.every(0.01, boom, name="boom")
    runs: list[int] = []
    healthy = timer.every(0.01, lambda: runs.append(1), name="healthy")
    assert _wait_for(lambda: len(runs) >= 3)
    failing.stop()
    healthy.stop()


def _in_child(queue) -> None:
    runs: list[int] = []
    job = timer.every(0.01, lambda: runs.append(1), name="child")
    ok = _wait_for(lambda: len(runs) >= 2)
    job.stop()
    queue.put(ok)


def test_a_forked_child_gets_a_timer_thread_of_its_own() -> None:
    # The parent's thread is running (other tests started it); a prefork child must not rely on it.
    keep = timer.every(60.0, lambda: None, name="parent")
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=10) is True
    finally:
        child.join(10)
        keep.stop()
    assert child.exitcode == 0
