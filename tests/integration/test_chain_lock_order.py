"""Appending to an action's chain and moving the action take their locks in one order.

A transition holds the action's row and then appends its events (the chain trigger's append
lock). A bare append (a duplicate delivery's ``redelivery_ignored``, a quota wait) used to take the
append lock first and the row after, inside the trigger: with both on one action at once, each
waited on the other and Postgres ended one as a deadlock (180 ``DeadlockDetected`` in the
10,000-item soak). Now the trigger locks the row first: the bare append waits for the transition
to commit, then appends after it.
"""

from __future__ import annotations

import threading
import time

import psycopg

from ledger import store
from proofline.ledger_check import check_chains
from tests.conftest import create_database, drop_database

PLANT = """
INSERT INTO actions (action_id, run_id, tenant, action_type, server, tool, idempotency_key, status, envelope,
                     deadline)
VALUES ('a-1', 'run-a-1', 'acme', 'ticket.create', 'sor', 'create_ticket', 'k-a-1', 'published', '{}'::jsonb,
        now() + interval '1 hour')
"""


def _waiting(admin: str, application: str) -> bool:
    with psycopg.connect(admin, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                           "AND wait_event_type = 'Lock'", (application,)).fetchone()
        return bool(row and row[0])


def test_a_bare_append_during_a_transition_waits_instead_of_deadlocking() -> None:
    admin, _ = create_database("pl_chain_order")
    try:
        with store.connect(admin) as conn, conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")  # planted as published, triggers off
            conn.execute(PLANT)
        errors: list[BaseException] = []
        holder = store.connect(admin, application_name="chain-order-holder")
        try:
            with store.transaction(holder) as cur:
                # What a transition or a claim holds first: the action's row.
                cur.execute("SELECT 1 FROM actions WHERE action_id = 'a-1' FOR UPDATE")

                def bare_append() -> None:
                    try:
                        with store.connect(admin, application_name="chain-order-append") as other, \
                                store.transaction(other) as theirs:
                            store.append_event_txn(theirs, "a-1", "redelivery_ignored", "worker-2", {})
                    except BaseException as exc:  # noqa: BLE001 - reported below
                        errors.append(exc)

                appender = threading.Thread(target=bare_append)
                appender.start()
                deadline = time.monotonic() + 10
                while not _waiting(admin, "chain-order-append") and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert _waiting(admin, "chain-order-append"), "the bare append should be waiting on a lock"
                # The holder appends now (longer than deadlock_timeout later: a cycle would be found).
                time.sleep(1.2)
                store.append_event_txn(cur, "a-1", "lease_acquired", "worker-1", {})
            appender.join(30)
        finally:
            holder.close()
        assert not errors, errors
        with store.connect(admin) as conn:
            with store.transaction(conn) as cur:
                assert [e["event"] for e in store.timeline(cur, "a-1")] == ["lease_acquired", "redelivery_ignored"]
            assert check_chains(conn)[2] == []
    finally:
        drop_database(admin)
