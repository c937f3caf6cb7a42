"""The worker's garbage-collector wiring (worker/heap.py), run in a fresh interpreter so that the
signals fire as Celery fires them in a worker and nothing frozen leaks into the test process."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_start_up_heap_is_frozen_before_the_fork_in_the_child_and_after_its_first_task() -> None:
    program = textwrap.dedent("""
        import gc
        from celery import signals
        import worker.heap  # noqa: F401
        seen = [gc.get_freeze_count()]
        signals.worker_init.send(sender=None)
        seen.append(gc.get_freeze_count())
        signals.worker_process_init.send(sender=None)
        held = [[object()] for _ in range(1000)]  # what a first task leaves behind for the process's life
        signals.task_postrun.send(sender=None, task_id="t1")
        seen.append(gc.get_freeze_count())
        more = [[object()] for _ in range(1000)]
        signals.task_postrun.send(sender=None, task_id="t2")  # only the first task freezes
        seen.append(gc.get_freeze_count())
        print(seen)
    """)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout
    before, at_init, after_first, after_second = eval(out)  # noqa: S307 - our own program's list of ints
    assert before == 0 < at_init
    assert after_first >= at_init + 1000  # the first task's long-lived objects joined the frozen heap
    assert after_second == after_first
