"""The consumer's marks of how far it took each queue (worker/queue_marks.py): which send times are
believed, and how often the marks are written. Pure logic; the writes go to a recording callback."""

from __future__ import annotations

import math
from typing import Any

from worker.queue_marks import PLAUSIBLE_SKEW_SECONDS, Marks, plausible, write

NOW = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


class Recorder:
    """Stands in for the consumer's connection runner; fails while ``down``."""

    def __init__(self) -> None:
        self.writes: list[dict[str, float]] = []
        self.down = False

    def __call__(self, fn: Any, consumer: str, marks: dict[str, float]) -> None:
        assert fn is write and consumer == "w1"
        if self.down:
            raise OSError("database away")
        self.writes.append(dict(marks))


def test_only_a_finite_number_near_now_is_a_send_time() -> None:
    assert plausible(NOW - 5, NOW) == NOW - 5 and plausible(int(NOW), NOW) == NOW
    for hostile in (None, "1800000000", True, math.nan, math.inf, NOW + PLAUSIBLE_SKEW_SECONDS + 1, 0, [NOW]):
        assert plausible(hostile, NOW) is None, hostile


def test_marks_only_rise_and_are_written_at_most_once_a_second() -> None:
    clock, run = Clock(), Recorder()
    marks = Marks("w1", run, clock=clock)
    marks.taken("actions.0", NOW - 10)  # the first is written at once
    marks.taken("actions.0", NOW - 9)
    marks.taken("actions.0", NOW - 20)  # older (a redelivery, a delayed retry): never lowers the mark
    marks.taken("verify.0", NOW - 8)
    assert run.writes == [{"actions.0": NOW - 10}]
    clock.now += 1.0
    marks.taken("actions.0", "garbage")  # not believed, but the due flush still happens
    assert run.writes[-1] == {"actions.0": NOW - 9, "verify.0": NOW - 8}
    clock.now += 1.0
    marks.taken(None, NOW)  # no queue: nothing to mark, nothing pending
    assert len(run.writes) == 2


def test_a_mark_that_could_not_be_written_is_written_with_the_next() -> None:
    clock, run = Clock(), Recorder()
    marks = Marks("w1", run, clock=clock)
    run.down = True
    marks.taken("actions.0", NOW - 10)
    assert run.writes == []
    run.down = False
    clock.now += 1.0
    marks.taken("actions.1", NOW - 5)
    assert run.writes == [{"actions.0": NOW - 10, "actions.1": NOW - 5}]
