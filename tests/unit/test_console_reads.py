"""The action page's timeline folding: long runs of one event and long middles fold under a count,
and no event is lost or reordered by folding."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from proofline.console.reads import (
    ENDS_SHOWN,
    LANE_ENDS,
    LONG_LANES,
    LONG_TIMELINE,
    RUN_SHOWN,
    folded_lanes,
    folded_timeline,
    latest_open,
    stage_durations,
    stage_timeline,
)


def _events(names: list[str]) -> list[dict[str, Any]]:
    start = datetime(2026, 12, 1, tzinfo=UTC)
    return stage_timeline([{"seq": i + 1, "at": start + timedelta(seconds=i), "event": n, "actor": "w",
                            "evidence": {}} for i, n in enumerate(names)])


def _flat(parts: list[dict[str, Any]]) -> list[int]:
    return [ev["seq"] for p in parts for ev in ([p["row"]] if "row" in p else p["fold"])]


def test_a_short_timeline_is_shown_whole() -> None:
    timeline = _events(["published", "validated", "lease_acquired", "tool_called", "final_state"])
    parts = folded_timeline(timeline)
    assert all("row" in p for p in parts) and _flat(parts) == [1, 2, 3, 4, 5]


def test_a_long_run_of_one_event_folds_under_a_count() -> None:
    timeline = _events(["published", *["retry_scheduled"] * 9, "final_state"])
    parts = folded_timeline(timeline)
    assert [p.get("label") for p in parts if "fold" in p] == [f"{9 - RUN_SHOWN} more retry_scheduled events "
                                                               f"(seq {2 + RUN_SHOWN}–10)"]
    assert len(parts) == 1 + RUN_SHOWN + 1 + 1 and _flat(parts) == list(range(1, 12))


def test_a_long_timeline_keeps_its_ends_open_and_folds_the_middle() -> None:
    names = [f"e{i % 2}" for i in range(LONG_TIMELINE + 30)]  # alternating: no run to fold
    parts = folded_timeline(_events(names))
    assert len(parts) == 2 * ENDS_SHOWN + 1 and "fold" in parts[ENDS_SHOWN]
    assert parts[ENDS_SHOWN]["label"].startswith(f"{len(names) - 2 * ENDS_SHOWN} events in between")
    assert _flat(parts) == list(range(1, len(names) + 1))


def test_the_stage_lanes_of_many_attempts_fold_between_the_first_and_the_last() -> None:
    attempt = ["validated", "lease_acquired", "preconditions_passed", "tool_called", "retry_scheduled"]
    bars = stage_durations(_events(["published", *attempt * 6, "final_state"]))
    assert len(bars) > LONG_LANES
    lanes = folded_lanes(bars)
    assert len(lanes["head"]) == len(lanes["tail"]) == LANE_ENDS
    assert lanes["head"] + lanes["middle"] + lanes["tail"] == bars  # nothing dropped, nothing moved
    short = stage_durations(_events(["published", *attempt, "final_state"]))
    assert folded_lanes(short) == {"head": short, "middle": [], "tail": []}


def test_repeated_checks_and_calls_keep_the_latest_open_and_count_the_earlier() -> None:
    calls = [{"event": "tool_called", "evidence": {"outcome": o}}
             for o in ("failed_before_side_effect", "unknown_outcome", "failed_before_side_effect", "completed_verified")]
    folded = latest_open(calls)
    assert folded["latest"] is calls[-1] and folded["earlier"] == calls[:-1]
    assert folded["kinds"] == {"failed_before_side_effect": 2, "unknown_outcome": 1}
    assert latest_open([]) == {"latest": None, "earlier": [], "kinds": {}}
