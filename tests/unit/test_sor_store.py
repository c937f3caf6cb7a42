"""The system-of-record store: effects are exact ground truth, and every switch is deterministic."""

from __future__ import annotations

import sqlite3
from concurrent.futures import ThreadPoolExecutor

import pytest

from proofline_kit.processes import wait_for
from proofline_kit.sor import store


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "sor.sqlite3"
    store.seed_demo(path)
    return path


def test_init_db_is_idempotent_and_uses_wal(tmp_path):
    path = tmp_path / "nested" / "dir" / "sor.sqlite3"
    store.init_db(path)
    store.init_db(path)
    conn = store.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
    finally:
        conn.close()


def test_db_path_defaults_to_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SOR_DB", str(tmp_path / "from-env.sqlite3"))
    assert store.resolve_path() == tmp_path / "from-env.sqlite3"


def test_readonly_connection_cannot_write(db):
    conn = store.connect(db, readonly=True)
    try:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            conn.execute("DELETE FROM tickets")
    finally:
        conn.close()


def test_create_ticket_dedups_on_key_with_one_effect(db):
    first = store.create_ticket(db, "acme", "Disk full", "alice", idempotency_key="k1")
    again = store.create_ticket(db, "acme", "Disk full", "alice", idempotency_key="k1")
    assert first == {**again, "deduplicated": False}
    assert again["deduplicated"] is True
    assert store.count_effects(db, "k1") == 1
    found = store.find_ticket_by_key(db, "k1")
    assert found["found"] and found["ticket"]["id"] == first["ticket_id"]


def test_create_ticket_without_key_applies_every_time(db):
    a = store.create_ticket(db, "acme", "x", "o")
    b = store.create_ticket(db, "acme", "x", "o")
    assert a["ticket_id"] != b["ticket_id"]


def test_non_honouring_writes_count_every_effect(db):
    store.issue_refund(db, "acct-1", "acme", 100, "dup", idempotency_key="r1")
    store.issue_refund(db, "acct-1", "acme", 100, "dup", idempotency_key="r1")
    assert store.count_effects(db, "r1") == 2
    assert [e["tool"] for e in store.effects(db, "r1")] == ["issue_refund", "issue_refund"]
    assert len(store.find_refund_by_key(db, "r1")["refunds"]) == 2
    assert store.get_account(db, "acct-1")["account"]["balance_cents"] == 100_000 - 200


def test_close_ticket_version_conflict_applies_nothing(db):
    ticket = store.put_ticket(db, "acme", "t", "o")
    store.bump_version(db, "ticket", ticket)  # somebody else changed it
    with pytest.raises(store.Refused) as refused:
        store.close_ticket(db, ticket, expected_version=1, idempotency_key="c1")
    assert refused.value.reason == "version_conflict"
    assert store.count_effects(db, "c1") == 0
    closed = store.close_ticket(db, ticket, expected_version=2, idempotency_key="c1")
    assert closed == {"ticket_id": ticket, "status": "closed", "version": 3}
    assert store.get_ticket(db, ticket)["ticket"]["status"] == "closed"


def test_restart_completes_lazily_after_ready_at(db):
    accepted = store.restart_service(db, "checkout", "acme", 1, idempotency_key="rs1", restart_seconds=0.2)
    op_id = accepted["operation_id"]
    assert accepted == {"operation_id": op_id, "state": "accepted"}
    service = store.get_service(db, "checkout")
    assert (service["state"], service["healthy_instances"], service["generation"]) == ("restarting", 0, 2)
    assert store.get_operation(db, op_id)["operation"]["state"] == "running"
    with pytest.raises(store.Refused, match="conflicting_operation"):
        store.restart_service(db, "checkout", "acme", 2, restart_seconds=0.2)

    # Once ready_at has passed, readers see the settled view without writing ...
    wait_for(lambda: store.get_operation(db, op_id)["operation"]["state"] == "completed", 10,
             what="the restart's ready_at to pass")
    service = store.get_service(db, "checkout")
    assert service == {
        **service,
        "state": "running",
        "healthy_instances": 3,
        "active_operation": None,
        "generation": 3,
    }
    # ... and the next write persists exactly that view.
    store.create_ticket(db, "acme", "after restart", "o")
    assert store.get_service(db, "checkout")["generation"] == 3
    assert [e["tool"] for e in store.effects(db)][-2:] == ["operation_completed", "create_ticket"]
    assert store.count_effects(db, "rs1") == 1


def test_restart_refuses_wrong_tenant_and_generation(db):
    with pytest.raises(store.Refused, match="tenant_mismatch"):
        store.restart_service(db, "checkout", "globex", 1)
    with pytest.raises(store.Refused, match="version_conflict"):
        store.restart_service(db, "checkout", "acme", 7)
    assert store.effects(db) == []


def test_refund_reversal_is_idempotent_compensation(db):
    refund = store.issue_refund(db, "acct-1", "acme", 1500, "late delivery")
    assert store.reverse_refund(db, refund["refund_id"], idempotency_key="rev1")["deduplicated"] is False
    assert store.reverse_refund(db, refund["refund_id"], idempotency_key="rev1")["deduplicated"] is True
    assert store.count_effects(db, "rev1") == 1
    account = store.get_account(db, "acct-1")
    assert account["account"]["balance_cents"] == 100_000
    assert account["refunds"][0]["status"] == "reversed"


def test_refund_refusals(db):
    with pytest.raises(store.Refused, match="insufficient_balance"):
        store.issue_refund(db, "acct-2", "globex", 10**9, "too much")
    with pytest.raises(store.Refused, match="tenant_mismatch"):
        store.issue_refund(db, "acct-1", "globex", 1, "wrong tenant")


def test_faults_count_down_and_forever(db):
    store.set_fault(db, "create_ticket", "delay", remaining=2, delay_seconds=0.5)
    assert store.take_fault(db, "create_ticket").mode == "delay"
    assert store.take_fault(db, "create_ticket").delay_seconds == 0.5
    assert store.take_fault(db, "create_ticket") is None  # spent: inert
    assert store.list_faults(db)[0]["remaining"] == 0

    store.set_fault(db, "issue_refund", "lie", remaining=-1)
    for _ in range(3):
        assert store.take_fault(db, "issue_refund").mode == "lie"
    store.clear_faults(db)
    assert store.take_fault(db, "issue_refund") is None


def test_readonly_take_fault_peeks_without_spending(db):
    store.set_fault(db, "get_ticket", "delay", remaining=1)
    assert store.take_fault(db, "get_ticket", readonly=True) is not None
    assert store.take_fault(db, "get_ticket", readonly=True) is not None
    assert store.list_faults(db)[0]["remaining"] == 1


def test_unknown_fault_mode_is_rejected(db):
    with pytest.raises(ValueError):
        store.set_fault(db, "create_ticket", "explode")


def test_bump_version_records_an_external_change(db):
    assert store.bump_version(db, "service", "search") == 2
    assert store.effects(db)[-1]["tool"] == "external_change"
    assert store.get_service(db, "search")["generation"] == 2


def test_concurrent_creates_with_one_key_apply_once(db):
    # BEGIN IMMEDIATE serialises the check-then-insert, so racing callers cannot both insert.
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(
            pool.map(lambda _: store.create_ticket(db, "acme", "race", "o", "race-key"), range(16))
        )
    assert len({r["ticket_id"] for r in results}) == 1
    assert sum(not r["deduplicated"] for r in results) == 1
    assert store.count_effects(db, "race-key") == 1
