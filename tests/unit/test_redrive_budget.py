"""The re-drive budget's arithmetic (``recovery/redrive_budget.py``); the sweep that applies it runs
against a real stack in ``tests/faults/test_redrive_budget.py``."""

from __future__ import annotations

from recovery.redrive_budget import limit_for, window_seconds


def test_the_budget_is_twice_the_drain_less_what_still_waits() -> None:
    # 60 starts over 30 s is 2 a second: a sweep 5 s after the last one may re-send 2 x 10, less
    # the re-sends that still wait.
    assert limit_for(60, 0, 30.0, 5.0, 1.0, 3, 200) == 20
    assert limit_for(60, 12, 30.0, 5.0, 1.0, 3, 200) == 8
    assert limit_for(60, 0, 30.0, 5.0, 0.5, 3, 200) == 10


def test_the_budget_stays_between_the_floor_and_the_sweep_limit() -> None:
    assert limit_for(0, 0, 30.0, 5.0, 1.0, 3, 200) == 3  # nothing drains: lost messages still go out
    assert limit_for(60, 500, 30.0, 5.0, 1.0, 3, 200) == 3  # re-sends queue up: back to the floor
    assert limit_for(10_000, 0, 30.0, 5.0, 1.0, 3, 200) == 200


def test_while_the_workers_keep_up_the_budget_grows() -> None:
    # Every re-send starts at once (idle workers, every message lost): sweeps a second apart, each
    # re-sending its budget; the drain over the window is what the sweeps sent in it.
    sent: list[int] = []
    for _ in range(90):
        started = sum(sent[-30:])
        sent.append(limit_for(started, 0, 30.0, 1.0, 1.0, 10, 200))
    assert sent[0] == 10 and sent[-1] == 200
    assert sent[20] > sent[0] and sent == sorted(sent)


def test_the_drain_is_measured_over_six_periods_and_never_less_than_half_a_minute() -> None:
    assert window_seconds(1.0) == 30.0
    assert window_seconds(10.0) == 60.0
