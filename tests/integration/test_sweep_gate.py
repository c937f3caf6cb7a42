"""A fleet-wide sweep runs once per period, whoever sends it, and survives its holder's death.

Real Postgres, the recovery role's connections (what a sweeping worker uses), and for the death of
a holder a real process killed with SIGKILL while it sweeps. What is counted is the sweep bodies
that actually ran (counted in Python, outside the table) against the ``sweep_runs`` rows. A run is
one transaction: what its body writes, and its row, commit together or not at all, and what it
leaves for after the commit runs only once the commit is visible to other sessions.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from ledger import heartbeat, store
from proofline.settings import ROOT
from recovery.sweep_gate import HOLDER_SQL, SweepRun, Swept, lock_name, run_once
from tests.conftest import create_database, drop_database, role_urls, wait_for

PERIOD = 0.5


@pytest.fixture()
def db() -> Iterator[dict[str, str]]:
    admin, _ = create_database("pl_sweepgate")
    try:
        yield {"admin": admin, **role_urls(admin)}
    finally:
        drop_database(admin)


def runs(admin: str) -> list[dict[str, Any]]:
    with store.connect(admin) as conn:
        return list(conn.execute("SELECT * FROM sweep_runs ORDER BY run_id").fetchall())


#: Periods the concurrent sweepers must have run before they stop.
PERIODS_RUN = 6


def test_concurrent_sweepers_run_each_period_once_and_never_overlap(db) -> None:
    """Four sweepers (as four nodes' beats would) try every 50 ms until six periods have each had
    their run and more than one sweeper has won one; a period is 0.5 s."""
    ran: list[tuple[str, int, float, float]] = []
    guard = threading.Lock()
    stop = threading.Event()

    def sweeper(name: str) -> None:
        conn = store.connect(db["recovery"])
        try:
            while not stop.is_set():
                def body(run: SweepRun, cur: Any, name: str = name) -> Swept:
                    start = time.monotonic()
                    time.sleep(0.12)  # long enough for the others to try while it runs
                    with guard:
                        ran.append((name, run.slot, start, time.monotonic()))
                    return Swept({"swept": 1})

                run_once(conn, "reconcile", PERIOD, name, body)
                time.sleep(0.05)
        finally:
            conn.close()

    def enough() -> bool:
        with guard:
            return len({slot for _, slot, _, _ in ran}) >= PERIODS_RUN and len({name for name, *_ in ran}) > 1

    threads = [threading.Thread(target=sweeper, args=(f"node{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        # Waited on, not timed: on a loaded machine a sweeper may miss a period, never run one twice.
        wait_for(enough, 120, what=f"{PERIODS_RUN} periods swept, by more than one sweeper")
    finally:
        stop.set()
        for t in threads:
            t.join(30)

    slots = [slot for _, slot, _, _ in ran]
    assert len(slots) == len(set(slots)), f"a period ran twice: {sorted(slots)}"
    # Never two bodies at once, across periods too (the advisory lock, held until the run commits).
    spans = sorted((start, end) for _, _, start, end in ran)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False)), spans
    rows = runs(db["admin"])
    assert [(r["holder"], r["slot"]) for r in rows] == [(name, slot) for name, slot, _, _ in
                                                       sorted(ran, key=lambda x: x[2])]
    assert all(r["finished_at"] is not None and r["counts"] == {"swept": 1} for r in rows)
    # The next period is free as soon as it begins: the first try in a new period runs it.
    conn = store.connect(db["recovery"])
    try:
        last = max(slots)
        wait_for(lambda: run_once(conn, "reconcile", PERIOD, "late", lambda run, cur: Swept({})), 30,
                 what="a run in a later period")
        assert runs(db["admin"])[-1]["slot"] > last
    finally:
        conn.close()


HOLDER = """
import sys, time
from ledger import store
from recovery.sweep_gate import Swept, run_once
conn = store.connect(sys.argv[1])
def body(run, cur):
    print("holding", run.run_id, conn.info.backend_pid, flush=True)
    time.sleep(120)
    return Swept({})
run_once(conn, "reconcile", float(sys.argv[2]), "doomed", body)
"""


def holders(admin: str) -> list[dict[str, Any]]:
    with store.connect(admin) as conn:
        return list(conn.execute(HOLDER_SQL, (lock_name("reconcile"),)).fetchall())


def test_a_holder_killed_mid_sweep_hands_the_sweep_over(db) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, db["recovery"], str(PERIOD)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    conn = store.connect(db["recovery"])
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        assert line.startswith("holding"), line
        doomed_run, doomed_pid = (int(x) for x in line.split()[1:3])
        # While it holds the sweep, nobody else sweeps, in this period or the next ones. Its run is
        # not committed, so sweep_runs does not show it; the lock's holder is its session.
        deadline = time.monotonic() + 4 * PERIOD
        while time.monotonic() < deadline:
            assert run_once(conn, "reconcile", PERIOD, "survivor", lambda run, cur: Swept({"swept": 1})) is None
            time.sleep(0.05)
        assert runs(db["admin"]) == []
        assert [(h["pid"], h["state"]) for h in holders(db["admin"])] == [(doomed_pid, "idle in transaction")]
        holder.kill()
        holder.wait(10)
        taken: list[SweepRun] = []

        def taken_over() -> bool:
            run = run_once(conn, "reconcile", PERIOD, "survivor", lambda run, cur: Swept({"swept": 1}))
            if run is not None:
                taken.append(run)
            return bool(taken)

        wait_for(taken_over, 60, what="the survivor to take the sweep over")
        rows = {r["run_id"]: r for r in runs(db["admin"])}
        # The dead holder's run rolled back with its session: no row, claim included.
        assert doomed_run not in rows and {r["holder"] for r in rows.values()} == {"survivor"}
        assert taken[0].run_id > doomed_run  # the run id is the fencing token: later runs are larger
        assert rows[taken[0].run_id]["finished_at"] is not None
        assert holders(db["admin"]) == []
    finally:
        if holder.poll() is None:
            holder.kill()
        conn.close()


def beats(admin: str) -> dict[str, Any]:
    with store.connect(admin) as conn:
        return {r["sweeper"]: r["counts"] for r in conn.execute("SELECT * FROM reconciler_heartbeats").fetchall()}


def test_a_failing_sweep_rolls_its_work_back_is_recorded_and_frees_the_next_period(db) -> None:
    conn = store.connect(db["recovery"])
    try:
        def boom(run: SweepRun, cur: Any) -> Swept:
            heartbeat.beat_txn(cur, "w1", {"half": 1})  # written, then rolled back with the body
            raise RuntimeError("sweep defect")

        with pytest.raises(RuntimeError):
            run_once(conn, "reconcile", PERIOD, "w1", boom)
        failed = runs(db["admin"])[-1]
        assert failed["counts"] == {"error": "RuntimeError"} and failed["finished_at"] is not None
        assert beats(db["admin"]) == {}
        other = store.connect(db["recovery"])
        try:
            done: list[SweepRun] = []

            def next_period_ran() -> bool:
                run = run_once(other, "reconcile", PERIOD, "w2", lambda run, cur: Swept({}))
                if run is not None:
                    done.append(run)
                return bool(done)

            wait_for(next_period_ran, 30, what="another sweeper to run the next period")
            assert done[0].slot > failed["slot"]
        finally:
            other.close()
    finally:
        conn.close()


def test_what_a_run_leaves_for_after_its_commit_sees_it_committed_and_its_failure_is_noted(db) -> None:
    conn = store.connect(db["recovery"])
    try:
        seen: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []

        def then() -> None:
            # Another session sees the run finished and the body's write: both committed first.
            seen.append((runs(db["admin"]), beats(db["admin"])))
            raise ConnectionError("broker gone")

        def body(run: SweepRun, cur: Any) -> Swept:
            heartbeat.beat_txn(cur, "w1", {"found": 2})
            return Swept({"found": 2}, then=then)

        with pytest.raises(ConnectionError):
            run_once(conn, "reconcile", PERIOD, "w1", body)
        [(committed, beat)] = seen
        assert [(r["holder"], r["counts"], r["finished_at"] is not None) for r in committed] == \
            [("w1", {"found": 2}, True)]
        assert beat == {"w1": {"found": 2}}
        # The failure after the commit is noted on the run; the committed counts stand.
        assert runs(db["admin"])[-1]["counts"] == {"found": 2, "error_after_commit": "ConnectionError"}
    finally:
        conn.close()


def test_old_runs_are_pruned_and_only_the_recovery_roles_may_sweep(db) -> None:
    with store.connect(db["admin"]) as admin:
        admin.execute("INSERT INTO sweep_runs (sweep, slot, holder, started_at) "
                      "VALUES ('reconcile', 1, 'ancient', clock_timestamp() - interval '2 days')")
    conn = store.connect(db["recovery"])
    try:
        assert run_once(conn, "reconcile", PERIOD, "w1", lambda run, cur: Swept({})) is not None
    finally:
        conn.close()
    assert [r["holder"] for r in runs(db["admin"])] == ["w1"]
    # An execute-only worker cannot claim a sweep (the reconcile queue is the recovery role's).
    worker = store.connect(db["worker"])
    try:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            run_once(worker, "reconcile", PERIOD, "w2", lambda run, cur: Swept({}))
    finally:
        worker.close()
