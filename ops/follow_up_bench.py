"""The reconciler's follow-up sweep over a large ledger: its query now, against the query it had
before (every settled action read), in one run on one scratch database.

    .venv/bin/python -m ops.follow_up_bench [--settled 100000] [--repeat 5]

The database is migrated, then filled with ``--settled`` closed actions nothing waits on (written
with the ledger's triggers off: only the sweep's query is measured) and one settled run step whose
next step is pending. Both queries run ``--repeat`` times, each in a transaction rolled back; the
script prints the median of each, their ratio, the load average, and checks both found the same row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import psycopg
from psycopg import Rollback

from ledger import store
from proofline_kit.resources import create_database, drop_database
from recovery.reconciler import CLAIM_SQL, SWEEPS

#: The follow-up condition as it was before it started from the waiting rows (the baseline).
BEFORE = ("a.status IN ('closed', 'escalated', 'cancelled') AND a.updated_at > clock_timestamp() - "
          "interval '1 day' AND a.updated_at < clock_timestamp() - make_interval(secs => %(stale)s) AND ("
          "(a.kind <> 'action' AND EXISTS (SELECT 1 FROM actions p WHERE p.action_id = a.parent_action_id "
          "AND p.status = 'recovery')) OR EXISTS (SELECT 1 FROM actions n WHERE n.run_id = a.run_id "
          "AND n.step = a.step + 1 AND n.status = 'pending'))")
NOW = next(condition for name, condition, _ in SWEEPS if name == "follow_up")
PARAMS = {"limit": 200, "backoff": 60.0, "stale": 1.0, "verify_stale": 180.0}

FILL = """
INSERT INTO actions (action_id, run_id, step, tenant, action_type, server, tool, idempotency_key, status, envelope,
                     deadline, updated_at, next_check_at, published_at)
SELECT 'bulk-' || g, 'run-bulk-' || g, 0, 'acme', 'ticket.create', 'sor', 'create_ticket', 'k-bulk-' || g, 'closed'::action_status,
       '{}'::jsonb, now() + interval '1 hour', now() - interval '1 hour', now() - interval '1 hour',
       now() - interval '1 hour'
FROM generate_series(1, %(n)s) g
UNION ALL SELECT 'step-0', 'run-x', 0, 'acme', 'ticket.create', 'sor', 'create_ticket', 'k-step-0', 'closed',
       '{}'::jsonb, now() + interval '1 hour', now() - interval '1 minute', now() - interval '1 minute', now()
UNION ALL SELECT 'step-1', 'run-x', 1, 'acme', 'ticket.create', 'sor', 'create_ticket', 'k-step-1', 'pending',
       '{}'::jsonb, now() + interval '1 hour', now() - interval '1 minute', now() - interval '1 minute', now()
"""


def timed(conn: psycopg.Connection, condition: str, repeat: int) -> tuple[float, list[str]]:
    sql, times, found = CLAIM_SQL.format(condition=condition, limit="limit"), [], []
    for _ in range(repeat):
        started = time.perf_counter()
        with conn.transaction():
            found = sorted(r["action_id"] for r in conn.execute(sql, PARAMS).fetchall())
            times.append((time.perf_counter() - started) * 1000)
            raise Rollback()  # leave the rows as they were for the next run
    return statistics.median(times), found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settled", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    admin, _ = create_database("pl_followup_bench")
    try:
        with store.connect(admin) as conn:
            with conn.transaction():
                conn.execute("SET LOCAL session_replication_role = replica")  # the ledger's triggers off
                conn.execute(FILL, {"n": args.settled})
            conn.execute("ANALYZE actions")
            before_ms, before = timed(conn, BEFORE, args.repeat)
            now_ms, now = timed(conn, NOW, args.repeat)
    finally:
        drop_database(admin)
    print(f"follow-up sweep query over {args.settled} settled actions (median of {args.repeat}, "
          f"load average {os.getloadavg()[0]:.2f}): before {before_ms:.1f} ms, now {now_ms:.2f} ms, "
          f"ratio {before_ms / now_ms:.0f}x; found {now}")
    if before != now or now != ["step-0"]:
        print(f"MISMATCH: before found {before}, now found {now}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
