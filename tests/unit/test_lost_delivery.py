"""Which lost pool processes were killed from outside (worker/lost_delivery.py): pure logic."""

from __future__ import annotations

import signal
from pathlib import Path

from worker.lost_delivery import exit_status
from worker.oom_count import killed_from_outside, oom_kills


def test_only_a_kill_or_term_with_a_still_oom_counter_is_an_outside_kill() -> None:
    assert killed_from_outside(-signal.SIGKILL, 4, 4)
    assert killed_from_outside(-signal.SIGTERM, 0, 0)
    # The out-of-memory killer sends SIGKILL too: any OOM kill on the node meanwhile counts.
    assert not killed_from_outside(-signal.SIGKILL, 4, 5)
    # Unknown counters excuse nothing.
    assert not killed_from_outside(-signal.SIGKILL, None, 4)
    assert not killed_from_outside(-signal.SIGKILL, 4, None)
    # What a message can do to its own process: crash, abort, exit.
    for status in (-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS, 1, 0, None, "-9"):
        assert not killed_from_outside(status, 4, 4), status


def test_the_oom_counter_is_read_from_vmstat(tmp_path: Path) -> None:
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 1\noom_kill 17\nnr_foo 2\n")
    assert oom_kills(str(vmstat)) == 17
    vmstat.write_text("nr_free_pages 1\n")  # a kernel without the counter
    assert oom_kills(str(vmstat)) is None
    vmstat.write_text("oom_kill many\n")
    assert oom_kills(str(vmstat)) is None
    assert oom_kills(str(tmp_path / "absent")) is None


def test_the_exit_status_is_read_from_billiards_wording() -> None:
    from billiard.common import human_status
    from billiard.exceptions import WorkerLostError

    for status in (-signal.SIGKILL, -signal.SIGTERM, -signal.SIGSEGV, 1, 0):
        wording = f"Worker exited prematurely: {human_status(status)} Job: 7."
        assert exit_status(WorkerLostError(wording)) == status, wording
    assert exit_status(WorkerLostError("Worker exited prematurely: something else")) is None
    assert exit_status(RuntimeError("signal 9 (SIGKILL)")) is None


def test_every_task_both_excuses_outside_kills_and_shows_its_outcome_to_flower() -> None:
    """A request class set on one task replaces the base's: each task must end with both."""
    from celery.utils.imports import symbol_by_name

    from worker.lost_delivery import GuardedRequest
    from worker.task_request import OutcomeRequest
    from worker.tasks import app

    ours = {name: task for name, task in app.tasks.items() if name.startswith("proofline.")}
    assert {"proofline.execute", "proofline.verify", "proofline.compensate"} <= set(ours)
    for name, task in ours.items():
        request = symbol_by_name(task.Request)
        assert issubclass(request, GuardedRequest) and issubclass(request, OutcomeRequest), name
