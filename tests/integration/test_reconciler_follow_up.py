"""The reconciler's follow-up sweep finds the settled actions something still waits on, and only
those, without reading every settled action in the ledger; and two sweeps at once (each one
transaction for all its claims) never take the same action, nor take it again once it was taken.

Rows are written straight into a migrated database with the ledger's triggers off (this test checks
the sweep's query, not the transitions that normally lead to these states): a bulk of settled
actions nothing waits on, a settled run step whose next step is still pending, and a settled
compensation whose parent is still in recovery.
"""

from __future__ import annotations

from typing import Any

from ledger import store
from recovery.reconciler import CLAIM_SQL, SWEEPS, Taken, take
from tests.conftest import create_database, drop_database, role_urls

FOLLOW_UP = next(condition for name, condition, _ in SWEEPS if name == "follow_up")
PARAMS = {"limit": 200, "backoff": 60.0, "stale": 1.0, "verify_stale": 180.0}

INSERT = """
INSERT INTO actions (action_id, run_id, step, kind, parent_action_id, tenant, action_type, server, tool,
                     idempotency_key, status, envelope, deadline, updated_at, next_check_at, published_at)
VALUES (%(id)s, %(run)s, %(step)s, %(kind)s, %(parent)s, 'acme', 'ticket.create', 'sor', 'create_ticket',
        'k-' || %(id)s, %(status)s, '{}'::jsonb, now() + interval '1 hour', now() - interval '1 minute',
        now() - interval '1 minute', now() - interval '1 minute')
"""


def insert(conn: Any, action_id: str, status: str, run: str | None = None, step: int = 0, kind: str = "action",
           parent: str | None = None) -> None:
    conn.execute(INSERT, {"id": action_id, "run": run or f"run-{action_id}", "step": step, "kind": kind,
                          "parent": parent, "status": status})


def test_follow_up_finds_only_what_waits_and_reads_no_settled_bulk() -> None:
    admin, _ = create_database("pl_followup")
    try:
        with store.connect(admin) as conn:
            with conn.transaction():
                conn.execute("SET LOCAL session_replication_role = replica")  # the ledger's triggers off
                conn.execute("""INSERT INTO actions (action_id, run_id, tenant, action_type, server, tool,
                                    idempotency_key, status, envelope, deadline, updated_at, next_check_at, published_at)
                                SELECT 'bulk-' || g, 'run-bulk-' || g, 'acme', 'ticket.create', 'sor', 'create_ticket',
                                       'k-bulk-' || g, 'closed', '{}'::jsonb, now() + interval '1 hour',
                                       now() - interval '1 hour', now() - interval '1 hour', now() - interval '1 hour'
                                FROM generate_series(1, 50000) g""")
                insert(conn, "step-0", "closed", run="run-x", step=0)
                insert(conn, "step-1", "pending", run="run-x", step=1)
                insert(conn, "done-0", "closed", run="run-y", step=0)
                insert(conn, "done-1", "closed", run="run-y", step=1)
                insert(conn, "parent", "recovery")
                insert(conn, "parent.compensation", "escalated", kind="compensation", parent="parent")
                insert(conn, "calm-parent", "closed")
                insert(conn, "calm-parent.compensation", "closed", kind="compensation", parent="calm-parent")
            conn.execute("ANALYZE actions")
            sql = CLAIM_SQL.format(condition=FOLLOW_UP, limit="limit")
            plan = "\n".join(r["QUERY PLAN"] for r in conn.execute("EXPLAIN " + sql, PARAMS).fetchall())
            with conn.transaction():
                found = sorted(r["action_id"] for r in conn.execute(sql, PARAMS).fetchall())
        assert found == ["parent.compensation", "step-0"]
        # The 50,000 settled actions nothing waits on are not read one by one.
        assert "Seq Scan on actions" not in plan, plan
    finally:
        drop_database(admin)


def taken_ids(taken: Taken) -> dict[str, str]:
    return {row["action_id"]: row["status"] for row, _ in taken.redrives}


def test_two_sweeps_at_once_take_each_action_once_and_push_it_back() -> None:
    admin, _ = create_database("pl_twosweeps")
    try:
        with store.connect(admin) as conn, conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")  # the ledger's triggers off
            insert(conn, "step-0", "closed", run="run-x", step=0)
            insert(conn, "step-1", "pending", run="run-x", step=1)
            insert(conn, "verifying", "verifying")
            insert(conn, "recovering", "recovery")
        options = {"stale_seconds": 1.0, "verify_stale_seconds": 1.0}
        first, second = store.connect(role_urls(admin)["recovery"]), store.connect(role_urls(admin)["recovery"])
        try:
            with store.transaction(first) as one:
                a = take(one, "sweeper-a", **options)
                # The first sweep's transaction is still open: the second skips what it holds.
                with store.transaction(second) as two:
                    b = take(two, "sweeper-b", **options)
            # Committed: what was taken is pushed back by next_check_at, not taken again.
            with store.transaction(second) as two:
                c = take(two, "sweeper-b", **options)
        finally:
            first.close()
            second.close()
        assert taken_ids(a) == {"step-0": "closed", "verifying": "verifying", "recovering": "recovery"}
        assert (taken_ids(b), taken_ids(c)) == ({}, {})
        with store.connect(admin) as conn:
            events = conn.execute("SELECT action_id, actor, evidence->>'reason' AS reason FROM ledger_events "
                                  "WHERE event = 'redriven' ORDER BY action_id").fetchall()
        assert [(e["action_id"], e["actor"], e["reason"]) for e in events] == [
            ("recovering", "sweeper-a", "recovery_pending"), ("step-0", "sweeper-a", "follow_up"),
            ("verifying", "sweeper-a", "verification_stalled")]
    finally:
        drop_database(admin)
