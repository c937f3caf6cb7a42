"""What a worker's main process notes as held, and what its supervisor excuses after a run ended
(worker/in_flight.py): pure logic over a real folder; the excuse itself is a callback here."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from worker import in_flight


@pytest.fixture()
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "held"
    path.mkdir()
    monkeypatch.setenv(in_flight.ENV, str(path))
    return path


def test_a_message_is_held_from_its_note_until_it_is_done(folder: Path) -> None:
    assert in_flight.noting()
    in_flight.note("task:a", "proofline.execute", "act-1")
    in_flight.note("task:b", "proofline.verify", None)
    in_flight.done("task:a")
    in_flight.done("task:never-noted")  # an unknown key is no error
    assert in_flight.held(folder) == [{"key": "task:b", "task": "proofline.verify", "action_id": None}]


def test_nothing_is_noted_outside_the_supervisor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(in_flight.ENV, raising=False)
    assert not in_flight.noting()
    in_flight.note("task:a", "proofline.execute", "act-1")  # no folder: nothing written, no error
    in_flight.done("task:a")
    assert list(tmp_path.iterdir()) == []


def test_only_an_outside_kill_with_a_still_oom_count_or_a_clean_exit_excuses() -> None:
    assert in_flight.excuses(-signal.SIGKILL, 3, 3) and in_flight.excuses(-signal.SIGTERM, 0, 0)
    assert in_flight.excuses(0, None, None)  # stopped: what it had prefetched comes back
    assert not in_flight.excuses(-signal.SIGKILL, 3, 4)  # an out-of-memory kill on the node meanwhile
    assert not in_flight.excuses(-signal.SIGKILL, None, 3)
    for code in (1, 70, -signal.SIGSEGV, -signal.SIGABRT):
        assert not in_flight.excuses(code, 3, 3), code


def test_a_killed_run_excuses_what_it_held_and_leaves_an_empty_folder(folder: Path) -> None:
    in_flight.note("task:a", "proofline.execute", "act-1")
    in_flight.note("task:b", "proofline.execute", "act-2")
    (folder / "garbage").write_text("{not json")
    excused: list[tuple[str, str, str | None]] = []

    def excuse(key: str, task: str, action_id: str | None) -> object:
        excused.append((key, task, action_id))
        return None if key == "task:b" else {"excused": 1}  # b's excuses are spent

    assert in_flight.settle_run(folder, -signal.SIGKILL, 5, 5, excuse) == 1
    assert sorted(excused) == [("task:a", "proofline.execute", "act-1"), ("task:b", "proofline.execute", "act-2")]
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_a_crashed_run_excuses_nothing_and_a_failing_excuse_loses_nothing_else(folder: Path) -> None:
    in_flight.note("task:a", "proofline.execute", "act-1")
    called: list[str] = []
    assert in_flight.settle_run(folder, -signal.SIGSEGV, 5, 5, lambda *a: called.append(a[0])) == 0
    assert called == [] and list(folder.iterdir()) == []
    in_flight.note("task:a", "proofline.execute", "act-1")
    in_flight.note("task:b", "proofline.execute", "act-2")

    def flaky(key: str, task: str, action_id: str | None) -> object:
        if key == "task:a":
            raise OSError("database away")
        return {"excused": 1}

    assert in_flight.settle_run(folder, 0, None, None, flaky) == 1
    assert list(folder.iterdir()) == []
