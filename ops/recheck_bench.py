"""What pending post-condition re-checks cost an idle reconciler: its commits (and the messages it
sends) over a window with N re-checks scheduled but not due, against the same window with none.

    .venv/bin/python -m ops.recheck_bench [--pending 10000] [--window 20] [--interval 1]

One scratch database, migrated; the reconcile task's database work (``recovery/reconciler.py``
``sweep_once``: the period's claim, every sweep, the heartbeat, the run's stamp; then the authority
watch) runs every ``--interval`` seconds for ``--window`` seconds, as beat would send it, on the
runtime role. After a few uncounted periods of sweeping (a reconciler's first sweeps commit less
than its later ones), three windows, in order: none pending, ``--pending`` re-checks due in an hour (for as
many verified actions settled two days ago, written with the ledger's triggers off, so that only
the re-checks are new), and a calibration window in which
nothing sweeps (what the measuring itself commits). Autovacuum is off for the scratch tables (its
transactions would count too). Commits are read from
``pg_stat_database.xact_commit`` of the scratch database; each window forces the statistics of
its connections out before it reads them. The messages are what the sweep handed to the dispatcher
(a re-check sent is a worker task). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import psycopg

from ledger import store
from proofline.settings import Settings
from proofline_kit.resources import create_database, drop_database
from recovery.authority_watch import watch
from recovery.reconciler import sweep_once

#: Sweep periods run, and not counted, before the first window.
WARM_UP_PERIODS = 5

FILL = """
INSERT INTO actions (action_id, run_id, step, tenant, action_type, server, tool, idempotency_key, status, outcome,
                     envelope, deadline, updated_at, next_check_at, published_at)
SELECT 'verified-' || g, 'run-verified-' || g, 0, 'acme', 'ticket.create', 'sor', 'create_ticket', 'k-' || g,
       'closed'::action_status, 'completed_verified'::outcome_class, '{}'::jsonb, now() + interval '1 hour',
       now() - interval '2 days', now() + interval '1 day', now() - interval '2 days'
FROM generate_series(1, %(n)s) g
"""
CHECKS = """
INSERT INTO postcondition_checks (action_id, seq, recheck_key, offset_ms, due_at, horizon_at)
SELECT 'verified-' || g, 1, 'k-' || g || ':recheck:1', 3600000, now() + interval '1 hour', now() + interval '2 hours'
FROM generate_series(1, %(n)s) g
"""


class Counting:
    """A dispatcher that sends nothing and counts what it was handed."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}

    def _count(self, kind: str) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + 1

    def verify(self, action_id: str, tenant: str | None = None) -> None:
        self._count("verify")

    def recover(self, action_id: str) -> None:
        self._count("recover")

    def recheck(self, check_id: int, attempt: int, tenant: str | None = None) -> None:
        self._count("recheck")

    def execute(self, message: dict[str, Any], queue: str = "actions", task_id: str | None = None,
                countdown: float | None = None) -> str:
        self._count("execute")
        return "counted"

    def revoke(self, task_id: str) -> None:
        self._count("revoke")

    def oldest_waiting(self, queues: list[str]) -> dict[str, float]:
        return {}  # nothing waits on a broker this stands in for

    def settled(self, conn: Any, actor: str, action_id: str, **known: Any) -> None:
        self._count("settled")


def commits(observer: psycopg.Connection[dict[str, Any]]) -> int:
    row = observer.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row["xact_commit"])


def flush(conn: psycopg.Connection[dict[str, Any]]) -> None:
    """Push this session's pending statistics out (they are flushed lazily, up to 10 s late)."""
    conn.execute("SELECT pg_stat_force_next_flush()")


def window(observer: psycopg.Connection[dict[str, Any]], sweeper: psycopg.Connection[dict[str, Any]],
           settings: Settings, seconds: float, interval: float, sweep: bool) -> dict[str, Any]:
    """One window: commits of the database, sweeps run, messages handed out, sweep durations."""
    dispatch = Counting()
    flush(sweeper)
    flush(observer)
    time.sleep(0.2)
    start = commits(observer)
    attempts, runs, durations, claimed = 0, 0, [], 0
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        began = time.monotonic()
        if sweep:
            # A copy that finds its period already swept (beat's jitter) commits its empty claim too.
            attempts += 1
            run = sweep_once(sweeper, dispatch, settings)  # type: ignore[arg-type]
            if run is not None:
                runs += 1
                claimed += int(run.counts.get("rechecks_claimed", 0))
                watch(sweeper, settings, settings.worker_id)
            durations.append((time.monotonic() - began) * 1000)
        time.sleep(max(interval - (time.monotonic() - began), 0.0))
    flush(sweeper)
    flush(observer)
    time.sleep(0.2)
    return {"commits": commits(observer) - start, "attempts": attempts, "sweeps": runs, "sent": dispatch.sent,
            "rechecks_claimed": claimed,
            "sweep_ms_median": round(statistics.median(durations), 2) if durations else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pending", type=int, default=10_000)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    admin, runtime_url = create_database("pl_recheck_bench")
    settings = Settings(database_url=runtime_url, reconcile_interval_seconds=args.interval, worker_id="recheck-bench")
    try:
        with store.connect(admin) as observer, store.connect(runtime_url) as sweeper:
            # Autovacuum's transactions count in xact_commit too, at moments of its choosing: off for
            # the scratch tables, so that the windows count only what the reconciler commits.
            for row in observer.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall():
                observer.execute(f'ALTER TABLE "{row["tablename"]}" SET (autovacuum_enabled = false)')
            # A reconciler's first sweeps commit less than its later ones (their periodic work has not
            # come round yet): sweep a few periods first, uncounted, so both windows are steady state.
            window(observer, sweeper, settings, WARM_UP_PERIODS * args.interval, args.interval, sweep=True)
            idle = window(observer, sweeper, settings, args.window, args.interval, sweep=True)
            with observer.transaction():
                observer.execute("SET LOCAL session_replication_role = replica")  # the ledger's triggers off
                observer.execute(FILL, {"n": args.pending})
                observer.execute(CHECKS, {"n": args.pending})
            observer.execute("VACUUM ANALYZE actions")
            observer.execute("VACUUM ANALYZE postcondition_checks")
            pending = window(observer, sweeper, settings, args.window, args.interval, sweep=True)
            calibration = window(observer, sweeper, settings, args.window, args.interval, sweep=False)
    finally:
        drop_database(admin)
    # What the reconciler committed beyond one transaction per sweep attempt, in each window.
    extra = (pending["commits"] - pending["attempts"]) - (idle["commits"] - idle["attempts"])
    print(json.dumps({"window_seconds": args.window, "interval_seconds": args.interval, "pending": args.pending,
                      "none_pending": idle, "with_pending": pending, "measuring_only": calibration,
                      "extra_commits_with_pending": extra, "load_average": round(os.getloadavg()[0], 2)}))
    # Pending re-checks not yet due must cost no commit and no message: past one transaction per
    # sweep attempt, the two windows differ by no more than what measuring alone commits.
    ok = pending["sent"] == {} and pending["rechecks_claimed"] == 0 and abs(extra) <= calibration["commits"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
