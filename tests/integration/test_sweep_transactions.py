"""What one reconciler sweep costs Postgres, counted by Postgres itself.

``pg_stat_database.xact_commit`` and ``xact_rollback`` of a database of the test's own, read from a
session on another database (so the reading adds nothing), before and after a connection that runs
the sweep and closes: a backend reports its counts when it exits, and each autocommit statement is
one transaction there, as the cost benchmark counts them. The connection's own start-up transaction
is measured the same way (a connection that does nothing) and subtracted.

The sweep is the reconcile task's (``recovery.reconciler.sweep_once``): the period's claim, the
deadline expiry, the delivery prune, the five re-drive claims, the heartbeat and the run's finish.
Work is planted as rows written straight into the tables with the ledger's triggers off (as in
``test_reconciler_follow_up.py``); the sends are recorded by a dispatch that, at the moment of each
send, reads from another session whether the state that explains it is committed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from ledger import store
from proofline.settings import Settings
from proofline_kit.resources import with_database
from recovery.reconciler import sweep, sweep_once
from tests.conftest import create_database, drop_database, role_urls, wait_for

INSERT = """
INSERT INTO actions (action_id, run_id, step, kind, tenant, action_type, server, tool, idempotency_key, status,
                     envelope, deadline, updated_at, next_check_at, published_at)
VALUES (%(id)s, 'run-' || %(id)s, 0, 'action', 'acme', 'ticket.create', 'sor', 'create_ticket', 'k-' || %(id)s,
        %(status)s, '{}'::jsonb, now() + interval '1 hour', now() - interval '1 minute', now() - interval '1 minute',
        now() - interval '1 minute')
"""


@pytest.fixture()
def db() -> Iterator[dict[str, str]]:
    admin, _ = create_database("pl_sweeptx")
    try:
        yield {"admin": admin, "name": urlsplit(admin).path.lstrip("/"),
               "elsewhere": with_database(admin, "postgres"), **role_urls(admin)}
    finally:
        drop_database(admin)


def settings(interval: float) -> Settings:
    return Settings(worker_id="sweeper-1", reconcile_interval_seconds=interval, redrive_after_seconds=1.0,
                    verify_stall_seconds=1.0)


def totals(db: dict[str, str]) -> tuple[int, int]:
    with store.connect(db["elsewhere"]) as conn:
        row = conn.execute("SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s",
                           (db["name"],)).fetchone()
    assert row is not None
    return row["xact_commit"], row["xact_rollback"]


def gone(db: dict[str, str], pid: int) -> bool:
    with store.connect(db["elsewhere"]) as conn:
        return conn.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()["n"] == 0


def transactions(db: dict[str, str], work: Callable[[Any], Any]) -> tuple[int, int, Any]:
    """(commits, rollbacks, result) of ``work`` on a fresh recovery-role connection, its start-up
    transaction included; the counts are read once its backend has exited (and reported them)."""
    before = totals(db)
    conn = store.connect(db["recovery"])
    pid = conn.info.backend_pid
    try:
        result = work(conn)
    finally:
        conn.close()
    wait_for(lambda: gone(db, pid), 10, what="the sweeping backend to exit")
    after = totals(db)
    return after[0] - before[0], after[1] - before[1], result


def sweep_cost(db: dict[str, str], work: Callable[[Any], Any]) -> tuple[int, int, Any]:
    """Like :func:`transactions`, less what a connection that does nothing costs."""
    idle_commits, idle_rollbacks, _ = transactions(db, lambda conn: None)
    commits, rollbacks, result = transactions(db, work)
    return commits - idle_commits, rollbacks - idle_rollbacks, result


class SendRecorder:
    """The sends of a sweep. ``look``: with what another session saw of the ledger at each send
    (those reads are transactions on the database too: not while counting)."""

    def __init__(self, db: dict[str, str], look: bool = False) -> None:
        self.db, self.look = db, look
        self.sent: list[tuple[Any, ...]] = []

    def _sent(self, kind: str, action_id: str) -> None:
        if not self.look:
            self.sent.append((kind, action_id))
            return
        with store.connect(self.db["admin"]) as conn:
            events = [r["event"] for r in conn.execute(
                "SELECT event FROM ledger_events WHERE action_id = %s ORDER BY seq", (action_id,)).fetchall()]
            finished = conn.execute("SELECT count(*) AS n FROM sweep_runs WHERE finished_at IS NOT NULL").fetchone()
        self.sent.append((kind, action_id, events, finished["n"]))

    def verify(self, action_id: str, tenant: str | None = None) -> None:
        self._sent("verify", action_id)

    def recover(self, action_id: str) -> None:
        self._sent("recover", action_id)

    def recheck(self, check_id: int, attempt: int, tenant: str | None = None) -> None:
        self._sent("recheck", str(check_id))

    def execute(self, message: dict[str, Any], queue: str = "actions", task_id: str | None = None,
                countdown: float | None = None) -> str:
        self._sent("execute", message["envelope"]["action_id"])
        return "sent"

    def revoke(self, task_id: str) -> None:
        raise AssertionError("a sweep revokes nothing")

    def oldest_waiting(self, queues: list[str]) -> dict[str, float]:
        return {}  # nothing waits on a broker this stands in for

    def settled(self, conn: Any, actor: str, action_id: str, **known: Any) -> None:
        raise AssertionError("a sweep settles nothing itself")


def plant(db: dict[str, str], **rows: str) -> None:
    """Actions due for a re-drive, by id and status, written with the ledger's triggers off."""
    with store.connect(db["admin"]) as conn, conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        for action_id, status in rows.items():
            conn.execute(INSERT, {"id": action_id, "status": status})


def test_an_idle_sweep_is_one_commit(db) -> None:
    s = settings(0.2)
    for _ in range(3):
        time.sleep(0.25)  # a new period: the run is not skipped
        commits, rollbacks, run = sweep_cost(db, lambda conn: sweep_once(conn, SendRecorder(db), s))
        assert run is not None and not any(run.counts.values()), run
        assert (commits, rollbacks) == (1, 0)
    with store.connect(db["admin"]) as conn:
        runs = conn.execute("SELECT holder, finished_at, counts FROM sweep_runs").fetchall()
        beat = conn.execute("SELECT sweeper, counts FROM reconciler_heartbeats").fetchall()
    # What that one commit holds: the run's row, finished with its counts, and the heartbeat.
    assert len(runs) == 3 and all(r["holder"] == "sweeper-1" and r["finished_at"] for r in runs)
    assert [(b["sweeper"], b["counts"]) for b in beat] == [("sweeper-1", runs[-1]["counts"])]


def test_a_copy_that_finds_its_period_taken_is_one_transaction_and_sweeps_nothing(db) -> None:
    s = settings(3600.0)
    with store.connect(db["recovery"]) as conn:
        sweep_once(conn, SendRecorder(db), s)  # this period's run
    for _ in range(2):
        commits, rollbacks, second = sweep_cost(db, lambda conn: sweep_once(conn, SendRecorder(db), s))
        if second is None:
            break  # (else the hour turned in between and the second ran the new period: again)
    assert second is None
    assert (commits, rollbacks) == (1, 0)


def test_a_sweep_that_finds_work_takes_it_in_one_commit(db) -> None:
    plant(db, **{"stalled-verification": "verifying", "stuck-recovery": "recovery"})
    recorder = SendRecorder(db)
    commits, rollbacks, run = sweep_cost(db, lambda conn: sweep_once(conn, recorder, settings(0.2)))
    assert run is not None
    assert (run.counts["verification_stalled"], run.counts["recovery_pending"]) == (1, 1), run.counts
    assert (commits, rollbacks) == (1, 0)
    assert sorted(recorder.sent) == [("recover", "stuck-recovery"), ("verify", "stalled-verification")]


def test_a_sweep_sends_only_what_another_session_already_sees_committed(db) -> None:
    plant(db, **{"stalled-verification": "verifying", "stuck-recovery": "recovery"})
    recorder = SendRecorder(db, look=True)
    with store.connect(db["recovery"]) as conn:
        assert sweep_once(conn, recorder, settings(0.2)) is not None
    # At each send, its re-drive event and the finished run were visible outside the sweep's session.
    assert sorted(recorder.sent) == [("recover", "stuck-recovery", ["redriven"], 1),
                                     ("verify", "stalled-verification", ["redriven"], 1)]


def test_an_operator_sweep_finding_nothing_is_one_commit(db) -> None:
    """``proofline reconcile``: the same sweep without the gate (no run row, no heartbeat)."""
    commits, rollbacks, counts = sweep_cost(db, lambda conn: sweep(conn, SendRecorder(db), "cli:reconcile",
                                                                   stale_seconds=1.0, verify_stale_seconds=1.0))
    assert not any(counts.values()), counts
    assert (commits, rollbacks) == (1, 0)
