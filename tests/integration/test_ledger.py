"""The ledger on a real, freshly migrated Postgres database: enum and schema parity with the
Python declarations, the runtime role's privileges, the insert-only trigger, hash-chain
verification (library and CLI), redaction, guarded transitions and idempotency records."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Column, MetaData, Text, create_engine

from ledger import store
from ledger.migrate import sqlalchemy_url
from ledger.redact import MARK
from ledger.schema import metadata
from ledger.states import (
    ActionStatus,
    CaptureKind,
    IdempotencyStatus,
    KillSwitchScope,
    Outcome,
    RecheckStatus,
    RetentionClass,
    VerificationFinding,
)
from proofline.envelope import build_envelope
from proofline.errors import LeaseBusy, StaleLease, TransitionRefused
from proofline.ledger_check import check_chains
from proofline.settings import ROOT
from proofline_kit import zygote
from tests.conftest import create_database, drop_database, role_urls

Urls = tuple[str, str]


@pytest.fixture(scope="module")
def db() -> Iterator[Urls]:
    """(admin url, runtime-role url) of one migrated database shared by this module."""
    admin, runtime = create_database("pl_ledger")
    try:
        yield admin, runtime
    finally:
        drop_database(admin)


@pytest.fixture
def chain_db() -> Iterator[Urls]:
    """A database of its own, for tests that break chains on purpose."""
    admin, runtime = create_database("pl_ledger_chain")
    try:
        yield admin, runtime
    finally:
        drop_database(admin)


@pytest.fixture
def admin(db: Urls) -> Iterator[psycopg.Connection]:
    with store.connect(db[0]) as conn:
        yield conn


@pytest.fixture
def runtime(db: Urls) -> Iterator[psycopg.Connection]:
    with store.connect(db[1]) as conn:
        yield conn


@pytest.fixture
def controller(db: Urls) -> Iterator[psycopg.Connection]:
    """Only the controller role publishes actions (migration 0003)."""
    with store.connect(role_urls(db[0])["controller"]) as conn:
        yield conn


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def events(conn: psycopg.Connection, action_id: str) -> list[dict[str, Any]]:
    with conn.cursor() as cur:
        cur.execute("SELECT * FROM ledger_events WHERE action_id = %s ORDER BY seq", (action_id,))
        return list(cur.fetchall())


def superuser_edit(conn: psycopg.Connection, sql: str, params: tuple[Any, ...]) -> None:
    """What only an owner can do: switch the insert-only trigger off, edit, switch it back on."""
    with store.transaction(conn) as cur:
        cur.execute("ALTER TABLE ledger_events DISABLE TRIGGER ledger_events_no_update")
        cur.execute(sql, params)
        assert cur.rowcount == 1
        cur.execute("ALTER TABLE ledger_events ENABLE TRIGGER ledger_events_no_update")


def verify_cli(runtime_url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")}
    env["PROOFLINE_DATABASE_URL"] = runtime_url
    env["PYTHONPATH"] = str(ROOT)
    return zygote.run([sys.executable, "-m", "proofline", "verify-ledger"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


# --- schema parity ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("type_name", "py_enum"),
    [("outcome_class", Outcome), ("action_status", ActionStatus), ("idempotency_status", IdempotencyStatus),
     ("kill_switch_scope", KillSwitchScope)],
)
def test_postgres_enum_equals_python_enum(admin, type_name, py_enum):
    with admin.cursor() as cur:
        cur.execute(
            """SELECT e.enumlabel FROM pg_enum e JOIN pg_type t ON t.oid = e.enumtypid
               WHERE t.typname = %s ORDER BY e.enumsortorder""",
            (type_name,),
        )
        labels = [r["enumlabel"] for r in cur.fetchall()]
    assert labels, f"no enum type {type_name}"
    assert set(labels) == {m.value for m in py_enum}
    assert len(labels) == len(py_enum)


def test_finding_check_equals_python_enum(admin):
    """``actions.finding`` is text guarded by a CHECK: the CHECK's list is the enum's, no more, no less."""
    with admin.cursor() as cur:
        cur.execute("""SELECT pg_get_constraintdef(c.oid) AS def FROM pg_constraint c
                       WHERE c.conname = 'actions_finding_known'""")
        [row] = cur.fetchall()
    labels = re.findall(r"'([a-z_]+)'::text", row["def"])
    assert sorted(labels) == sorted(m.value for m in VerificationFinding)
    assert "evidence_conflict" in labels


def test_capture_kind_check_equals_python_enum(admin):
    """``evidence_captures.kind`` is text guarded by a CHECK: the CHECK's list is CaptureKind's."""
    with admin.cursor() as cur:
        cur.execute("""SELECT pg_get_constraintdef(c.oid) AS def FROM pg_constraint c
                       WHERE c.conname = 'evidence_captures_kind_known'""")
        [row] = cur.fetchall()
    labels = re.findall(r"'([a-z_]+)'::text", row["def"])
    assert sorted(labels) == sorted(m.value for m in CaptureKind)


def test_recheck_status_check_equals_python_enum(admin):
    """``postcondition_checks.status`` is text guarded by a CHECK: its list is ``RecheckStatus``."""
    with admin.cursor() as cur:
        cur.execute("""SELECT pg_get_constraintdef(c.oid) AS def FROM pg_constraint c
                       WHERE c.conname = 'postcondition_checks_status_known'""")
        [row] = cur.fetchall()
    labels = re.findall(r"'([a-z_]+)'::text", row["def"])
    assert sorted(labels) == sorted(m.value for m in RecheckStatus)


@pytest.mark.parametrize("name", ["actions_retention_known", "message_deliveries_retention_known"])
def test_retention_checks_equal_python_enum(admin, name):
    """Retention classes are text guarded by a CHECK on each table that has one."""
    with admin.cursor() as cur:
        cur.execute("SELECT pg_get_constraintdef(c.oid) AS def FROM pg_constraint c WHERE c.conname = %s", (name,))
        [row] = cur.fetchall()
    assert sorted(re.findall(r"'([a-z_]+)'::text", row["def"])) == sorted(m.value for m in RetentionClass)


def _schema_diff(admin_url: str, target: MetaData) -> list[Any]:
    engine = create_engine(sqlalchemy_url(admin_url))
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True})
            return compare_metadata(context, target)
    finally:
        engine.dispose()


def test_migrated_schema_equals_declared_metadata(db):
    assert _schema_diff(db[0], metadata) == []


def test_schema_comparison_sees_a_difference(db):
    """The comparison above is live: a declaration with one extra column is reported."""
    changed = MetaData()
    for table in metadata.tables.values():
        table.to_metadata(changed)
    changed.tables["leases"].append_column(Column("extra_note", Text, nullable=True))
    diff = _schema_diff(db[0], changed)
    assert [(d[0], d[2], d[3].name) for d in diff] == [("add_column", "leases", "extra_note")]


def test_ledger_functions_and_triggers_exist(admin):
    with admin.cursor() as cur:
        cur.execute("""SELECT tgname FROM pg_trigger WHERE tgrelid = 'ledger_events'::regclass
                       AND NOT tgisinternal ORDER BY tgname""")
        assert [r["tgname"] for r in cur.fetchall()] == [
            "ledger_events_authorize", "ledger_events_chain", "ledger_events_no_truncate", "ledger_events_no_update"]


# --- privileges and the insert-only trigger --------------------------------------------------------


def test_runtime_role_can_insert_events(runtime):
    action = uid("act-ins")
    with store.transaction(runtime) as cur:
        store.append_event_txn(cur, action, "validated", "worker", {"n": 1})
        store.append_event_txn(cur, action, "executing", "worker", {"n": 2})
    rows = events(runtime, action)
    assert [(r["seq"], r["event"]) for r in rows] == [(1, "validated"), (2, "executing")]
    assert rows[0]["prev_hash"] == ""
    assert rows[1]["prev_hash"] == rows[0]["hash"]


def test_caller_cannot_choose_seq_or_hash(runtime):
    action = uid("act-forge")
    with store.transaction(runtime) as cur:
        cur.execute(
            """INSERT INTO ledger_events (action_id, seq, event, actor, prev_hash, hash, at)
               VALUES (%s, 41, 'validated', 'mallory', 'forged-prev', 'forged', '2000-01-01T00:00:00Z')""",
            (action,),
        )
    (row,) = events(runtime, action)
    assert (row["seq"], row["prev_hash"]) == (1, "")
    assert row["hash"] != "forged"
    assert row["at"] > datetime(2020, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE ledger_events SET evidence = '{\"x\": 1}'::jsonb WHERE action_id = %s",
        "DELETE FROM ledger_events WHERE action_id = %s",
        "TRUNCATE ledger_events",
    ],
    ids=["update", "delete", "truncate"],
)
def test_runtime_role_cannot_change_events(runtime, statement):
    action = uid("act-priv")
    with store.transaction(runtime) as cur:
        store.append_event_txn(cur, action, "validated", "worker", {"n": 1})
    params = (action,) if "%s" in statement else ()
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
        with store.transaction(runtime) as cur:
            cur.execute(statement, params)
    assert len(events(runtime, action)) == 1


def test_runtime_role_cannot_disable_the_trigger(runtime):
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        with store.transaction(runtime) as cur:
            cur.execute("ALTER TABLE ledger_events DISABLE TRIGGER ledger_events_no_update")


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE ledger_events SET actor = 'someone else' WHERE action_id = %s",
        "DELETE FROM ledger_events WHERE action_id = %s",
        "TRUNCATE ledger_events",
    ],
    ids=["update", "delete", "truncate"],
)
def test_trigger_refuses_even_the_superuser(admin, runtime, statement):
    action = uid("act-super")
    with store.transaction(runtime) as cur:
        store.append_event_txn(cur, action, "validated", "worker", {"n": 1})
    before = events(admin, action)
    params = (action,) if "%s" in statement else ()
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="insert-only"):
        with store.transaction(admin) as cur:
            cur.execute(statement, params)
    assert events(admin, action) == before


# --- hash chains -------------------------------------------------------------------------------------


def _write_chains(runtime_url: str, chains: dict[str, int]) -> None:
    with store.connect(runtime_url) as conn:
        for n in range(max(chains.values())):
            # Interleave the chains, in separate transactions, as concurrent workers would.
            for action, length in chains.items():
                if n < length:
                    with store.transaction(conn) as cur:
                        store.append_event_txn(cur, action, f"stage-{n + 1}", "worker",
                                               {"step": n + 1, "detail": {"ok": True, "items": [n, "x"]}})


def test_intact_chains_verify(chain_db):
    admin_url, runtime_url = chain_db
    _write_chains(runtime_url, {"act-a": 3, "act-b": 4, "act-c": 1})
    with store.connect(runtime_url) as conn:
        assert check_chains(conn) == (3, 8, [])
    done = verify_cli(runtime_url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 chains, 8 events checked" in done.stdout
    assert "BROKEN" not in done.stdout


def test_altered_and_removed_events_are_named(chain_db):
    admin_url, runtime_url = chain_db
    _write_chains(runtime_url, {"act-a": 3, "act-b": 4, "act-c": 2})
    with store.connect(admin_url) as conn:
        assert check_chains(conn)[2] == []
        superuser_edit(conn, "UPDATE ledger_events SET evidence = %s::jsonb WHERE action_id = %s AND seq = %s",
                       ('{"step": 2, "detail": {"ok": false, "items": [1, "x"]}}', "act-a", 2))
        chains, count, broken = check_chains(conn)
    assert (chains, count) == (3, 9)
    assert [(b.action_id, b.seq) for b in broken] == [("act-a", 2)]
    assert "altered" in broken[0].problem

    with store.connect(admin_url) as conn:
        superuser_edit(conn, "DELETE FROM ledger_events WHERE action_id = %s AND seq = %s", ("act-b", 2))
        chains, count, broken = check_chains(conn)
    assert (chains, count) == (3, 8)
    assert [(b.action_id, b.seq) for b in broken] == [("act-a", 2), ("act-b", 3)]
    assert "removed" in broken[1].problem and "from 1 to 3" in broken[1].problem

    done = verify_cli(runtime_url)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("BROKEN")]
    assert len(lines) == 2
    assert lines[0].startswith("BROKEN act-a at seq 2:") and "altered" in lines[0]
    assert lines[1].startswith("BROKEN act-b at seq 3:") and "removed" in lines[1]


def test_rehashed_event_is_caught_at_its_successor(chain_db):
    """Editing an event and recomputing its own hash still breaks the next link."""
    admin_url, runtime_url = chain_db
    _write_chains(runtime_url, {"act-a": 3})
    with store.connect(admin_url) as conn:
        superuser_edit(
            conn,
            """UPDATE ledger_events SET actor = 'mallory',
                   hash = ledger_event_hash(prev_hash, action_id, seq, event, 'mallory', at, evidence)
               WHERE action_id = %s AND seq = %s""",
            ("act-a", 1),
        )
        _, _, broken = check_chains(conn)
    assert [(b.action_id, b.seq) for b in broken] == [("act-a", 2)]
    assert "prev_hash" in broken[0].problem


def test_removed_first_event_is_named(chain_db):
    admin_url, runtime_url = chain_db
    _write_chains(runtime_url, {"act-a": 3})
    with store.connect(admin_url) as conn:
        superuser_edit(conn, "DELETE FROM ledger_events WHERE action_id = %s AND seq = %s", ("act-a", 1))
        _, _, broken = check_chains(conn)
    assert [(b.action_id, b.seq) for b in broken] == [("act-a", 2)]


def test_moving_text_between_event_and_actor_is_detected(chain_db):
    admin_url, runtime_url = chain_db
    with store.connect(runtime_url) as conn, store.transaction(conn) as cur:
        store.append_event_txn(cur, "act-a", "validated", "ops|alice", {"n": 1})
    with store.connect(admin_url) as conn:
        superuser_edit(conn, "UPDATE ledger_events SET event = %s, actor = %s WHERE action_id = %s AND seq = %s",
                       ("validated|ops", "alice", "act-a", 1))
        _, _, broken = check_chains(conn)
    assert [(b.action_id, b.seq) for b in broken] == [("act-a", 1)]


# --- redaction ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [["password"], ["PASSWORD"]])
def test_evidence_is_redacted_before_it_is_written(runtime, fields):
    action = uid("act-redact")
    evidence = {"user": "ann", "password": "hunter2", "nested": [{"Password": "s3cret", "keep": 1}]}
    with store.transaction(runtime) as cur:
        store.append_event_txn(cur, action, "validated", "worker", evidence, redact_fields=fields)
    (row,) = events(runtime, action)
    assert row["evidence"] == {"user": "ann", "password": MARK, "nested": [{"Password": MARK, "keep": 1}]}
    with runtime.cursor() as cur:
        cur.execute("SELECT evidence::text AS t FROM ledger_events WHERE action_id = %s", (action,))
        text = cur.fetchone()["t"]
    assert "hunter2" not in text and "s3cret" not in text
    assert evidence["password"] == "hunter2"


def test_batch_append_redacts_too(runtime):
    action = uid("act-batch")
    with store.transaction(runtime) as cur:
        store.append_events_txn(cur, action, "worker", [("a", {"token": "t1"}), ("b", {"ok": True})],
                                redact_fields=["token"])
    assert [(r["seq"], r["event"], r["evidence"]) for r in events(runtime, action)] == [
        (1, "a", {"token": MARK}), (2, "b", {"ok": True})]


# --- actions and transitions -------------------------------------------------------------------------


def _envelope(action_id: str) -> dict[str, Any]:
    now = datetime.now(UTC)
    env = build_envelope(
        run_id="run-1", action_id=action_id, workflow_type="agent.ops", action_type="ticket.create",
        requester="operator@example.com", workload_identity="agent:ops-assistant", tenant="acme",
        environment="production", target={"type": "ticket_queue", "id": "support"}, operation="create",
        arguments={"tenant": "acme", "title": "Disk full", "owner": "ops"},
        server={"name": "sor", "version": "1.0.0"}, tool={"name": "create_ticket", "contract_hash": "a" * 64},
        policy_version=5, approval={"id": "apr-1", "version": 1, "expires_at": now + timedelta(hours=1)},
        timeout_seconds=5, deadline=now + timedelta(minutes=10),
    )
    return env.model_dump(mode="json")


def test_insert_action_once(controller):
    action = uid("act-ins")
    envelope = _envelope(action)
    with store.transaction(controller) as cur:
        assert store.insert_action_txn(cur, envelope) is True
        assert store.insert_action_txn(cur, envelope) is False
        row = store.get_action(cur, action)
    assert row is not None
    assert (row.status, row.idempotency_key, row.tool) == (ActionStatus.published, envelope["idempotency_key"],
                                                           "create_ticket")
    assert row.envelope == envelope


def test_transition_moves_from_an_allowed_status(controller, runtime):
    action = uid("act-move")
    with store.transaction(controller) as cur:
        store.insert_action_txn(cur, _envelope(action))
    with store.transaction(runtime) as cur:
        row = store.transition_txn(cur, action, [ActionStatus.published], ActionStatus.executing,
                                   recovery_data={"before": {"found": False}})
    assert row.status is ActionStatus.executing
    assert row.recovery_data == {"before": {"found": False}}


def test_transition_refused_moves_nothing(controller, runtime):
    action = uid("act-refuse")
    with store.transaction(controller) as cur:
        store.insert_action_txn(cur, _envelope(action))
    with store.transaction(runtime) as cur:
        store.transition_txn(cur, action, [ActionStatus.published], ActionStatus.executing)
    with runtime.cursor() as cur:
        before = store.get_action(cur, action)

    with store.transaction(runtime) as cur:
        with pytest.raises(TransitionRefused, match="executing -> closed") as info:
            store.transition_txn(cur, action, [ActionStatus.published, ActionStatus.verifying], ActionStatus.closed,
                                 outcome=Outcome.completed_verified, finding="expected", reason_code="verified",
                                 result={"values": {}}, recovery_data={"x": 1})
        assert info.value.context["action_id"] == action
        # Nothing moved, even inside the same (still open) transaction.
        assert store.get_action(cur, action) == before
    with runtime.cursor() as cur:
        assert store.get_action(cur, action) == before


def test_transition_of_a_missing_action_refused(runtime):
    with store.transaction(runtime) as cur:
        with pytest.raises(TransitionRefused, match="missing"):
            store.transition_txn(cur, uid("act-none"), list(ActionStatus), ActionStatus.closed)


# --- idempotency records -------------------------------------------------------------------------------


def _token(cur: store.Cursor) -> int:
    cur.execute("SELECT nextval('lease_fencing_seq') AS t")
    return int(cur.fetchone()["t"])


def _claim(cur: store.Cursor, key: tuple[str, str], token: int, *, argument_hash: str = "h1",
           window: float = 3600.0) -> tuple[bool, store.IdempotencyRecord]:
    action_id, idempotency_key = key
    return store.claim_idempotency_txn(cur, key=idempotency_key, action_id=action_id, tenant="acme",
                                       argument_hash=argument_hash, contract_hash="c1", fencing_token=token,
                                       replay_window_seconds=window)


@pytest.fixture
def published(controller) -> tuple[str, str]:
    """(action id, idempotency key) of a freshly published action: a claim needs one (migration 0003)."""
    envelope = _envelope(uid("act-idem"))
    with store.transaction(controller) as cur:
        store.insert_action_txn(cur, envelope)
    return envelope["action_id"], envelope["idempotency_key"]


def test_first_claim_wins_and_second_gets_the_stored_record(runtime, published):
    key = published
    with store.transaction(runtime) as cur:
        first_token = _token(cur)
        claimed, record = _claim(cur, key, first_token)
    assert claimed is True
    assert (record.key, record.status, record.fencing_token, record.attempts, record.expired) == (
        key[1], IdempotencyStatus.in_progress, first_token, 1, False)

    with store.transaction(runtime) as cur:
        second_token = _token(cur)
        claimed, again = _claim(cur, key, second_token, argument_hash="h2")
    assert second_token != first_token
    assert claimed is False
    assert again == record  # the stored record, untouched by the second claim


def test_expired_record_is_reported_expired(runtime, published):
    with store.transaction(runtime) as cur:
        claimed, record = _claim(cur, published, _token(cur), window=-1)
        assert claimed is True
        claimed, again = _claim(cur, published, _token(cur))
    assert claimed is False
    assert again.expired is True


def test_update_with_the_current_token(runtime, published):
    key = published[1]
    with store.transaction(runtime) as cur:
        token = _token(cur)
        _claim(cur, published, token)
        attempts = store.update_idempotency_txn(cur, key, fencing_token=token, allowed=[IdempotencyStatus.in_progress],
                                                status=IdempotencyStatus.completed, result={"ticket": "T-1"},
                                                count_attempt=True)
        record = store.get_idempotency_txn(cur, key)
    assert attempts == 2
    assert record is not None
    assert (record.status, record.result, record.attempts) == (IdempotencyStatus.completed, {"ticket": "T-1"}, 2)


def test_update_with_a_stale_token_raises_and_moves_nothing(runtime, published):
    key = published[1]
    with store.transaction(runtime) as cur:
        old = _token(cur)
        _claim(cur, published, old)
        new = _token(cur)
        # A new lease holder takes the record over with its own token.
        store.update_idempotency_txn(cur, key, fencing_token=old, allowed=[IdempotencyStatus.in_progress],
                                     status=IdempotencyStatus.in_progress, new_token=new, count_attempt=True)
    with runtime.cursor() as cur:
        before = store.get_idempotency_txn(cur, key)
    assert before is not None and before.fencing_token == new

    with store.transaction(runtime) as cur:
        with pytest.raises(StaleLease) as info:
            store.update_idempotency_txn(cur, key, fencing_token=old, allowed=[IdempotencyStatus.in_progress],
                                         status=IdempotencyStatus.completed, result={"late": True})
        assert info.value.code == "stale_fencing_token"
        assert store.get_idempotency_txn(cur, key) == before


def test_update_from_a_status_not_allowed_raises(runtime, published):
    key = published[1]
    with store.transaction(runtime) as cur:
        token = _token(cur)
        _claim(cur, published, token)
        with pytest.raises(StaleLease):
            store.update_idempotency_txn(cur, key, fencing_token=token, allowed=[IdempotencyStatus.unknown],
                                         status=IdempotencyStatus.completed)
        record = store.get_idempotency_txn(cur, key)
    assert record is not None and record.status is IdempotencyStatus.in_progress


def test_removed_tail_is_caught_by_the_anchored_head(chain_db):
    """Deleting the last events leaves an internally consistent chain; the head the chain trigger
    anchors on the action row is what gives it away."""
    admin_url, runtime_url = chain_db
    action = uid("act-tail")
    with store.connect(role_urls(admin_url)["controller"]) as conn, store.transaction(conn) as cur:
        store.insert_action_txn(cur, _envelope(action))
    with store.connect(runtime_url) as conn, store.transaction(conn) as cur:
        for n in range(4):
            store.append_event_txn(cur, action, f"step-{n}", "worker", {"n": n})
    with store.connect(admin_url) as conn:
        assert check_chains(conn)[2] == []
        superuser_edit(conn, "DELETE FROM ledger_events WHERE action_id = %s AND seq = %s", (action, 4))
        _, _, broken = check_chains(conn)
    assert [(b.action_id, b.seq) for b in broken] == [(action, 4)]
    assert "removed" in broken[0].problem


# --- stage functions (migration 0012): one statement or one flight per worker stage ------------------


def _lease_args(action_id: str, locks: Any, token: int | None) -> dict[str, Any]:
    from worker.lease import lease_arguments

    return lease_arguments(action_id, locks.target, "w1", 30.0, locks, token)


def _claim_stage(conn: psycopg.Connection, envelope: dict[str, Any], locks: Any, token: int) -> bool:
    events = [("lease_acquired", {"fencing_token": token}), ("idempotency_claimed", {"fencing_token": token}),
              ("preconditions_passed", {})]
    return store.claim_and_start(
        conn, key=envelope["idempotency_key"], action_id=envelope["action_id"], tenant="acme",
        argument_hash=envelope["arguments_hash"], contract_hash="a" * 64, replay_window_seconds=3600.0,
        lease=_lease_args(envelope["action_id"], locks, token), recovery_data={"before": {"n": 1}},
        redactor=store.POLICY, events=events, actor="w1")


def _stage_state(conn: psycopg.Connection, envelope: dict[str, Any]) -> tuple[Any, ...]:
    with conn.cursor() as cur:
        action = store.get_action(cur, envelope["action_id"])
        record = store.get_idempotency_txn(cur, envelope["idempotency_key"])
        cur.execute("SELECT fencing_token FROM leases WHERE action_id = %s", (envelope["action_id"],))
        lease = cur.fetchone()
    assert action is not None
    return (action.status, record and (record.status, record.fencing_token), lease and lease["fencing_token"],
            [e["event"] for e in events(conn, envelope["action_id"])])


def test_the_claim_stage_is_one_transaction_that_writes_all_or_nothing(runtime, db, controller):
    from worker.lease import Locks, action_lock_name, target_lock_name, try_lock_and_read

    envelope = _envelope(uid("act-stage"))
    with store.transaction(controller) as cur:
        store.insert_action_txn(cur, envelope)
    locks = Locks(action_lock_name(envelope["action_id"]), target_lock_name("acme", "q", envelope["action_id"]))
    # Another session that never took the locks: refused by the database, nothing written.
    with store.connect(db[1]) as stranger:
        with pytest.raises(LeaseBusy) as lost:
            _claim_stage(stranger, envelope, locks, 10**9)
        assert lost.value.context["which"] == "lost"
    assert _stage_state(runtime, envelope) == (ActionStatus.published, None, None, [])

    facts = try_lock_and_read(runtime, locks, hold=True)  # opens the transaction the claim commits
    token = int(facts["fencing_token"])
    assert runtime.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    assert _claim_stage(runtime, envelope, locks, token) is True
    assert runtime.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    claimed = (ActionStatus.executing, (IdempotencyStatus.in_progress, token), token,
               ["lease_acquired", "idempotency_claimed", "preconditions_passed"])
    assert _stage_state(runtime, envelope) == claimed
    # A redelivery finds the record: nothing is written, the caller dispatches on the record.
    assert _claim_stage(runtime, envelope, locks, token + 1) is False
    assert _stage_state(runtime, envelope) == claimed


def test_a_pipelined_stage_is_rolled_back_whole_by_a_refusal(runtime, published):
    action, key = published
    with store.transaction(runtime) as cur:
        token = _token(cur)
        _claim(cur, published, token)
    before = _stage_state(runtime, {"action_id": action, "idempotency_key": key})
    # A stale token: the record's move is refused by the database, and the event queued before it goes too.
    with pytest.raises(StaleLease):
        with store.pipelined(runtime) as cur:
            store.append_event_txn(cur, action, "note", "w1", {})
            store.update_idempotency_txn(cur, key, fencing_token=token - 1, allowed=[IdempotencyStatus.in_progress],
                                         status=IdempotencyStatus.completed, deferred=True)
    # A move the action's status does not allow: refused the same way, after the record moved.
    with pytest.raises(TransitionRefused):
        with store.pipelined(runtime) as cur:
            store.update_idempotency_txn(cur, key, fencing_token=token, allowed=[IdempotencyStatus.in_progress],
                                         status=IdempotencyStatus.completed, deferred=True)
            store.transition_txn(cur, action, [ActionStatus.verifying], ActionStatus.closed, events=[("note", {})],
                                 actor="w1", deferred=True)
    assert runtime.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert _stage_state(runtime, {"action_id": action, "idempotency_key": key}) == before
    with store.pipelined(runtime) as cur:
        store.transition_txn(cur, action, [ActionStatus.published], ActionStatus.executing, events=[("note", {})],
                             actor="w1", deferred=True)
    assert _stage_state(runtime, {"action_id": action, "idempotency_key": key})[0] == ActionStatus.executing


def test_a_held_read_is_ended_by_any_other_write(runtime, published):
    action, _ = published
    with pytest.raises(psycopg.ProgrammingError):
        with store.pipelined(runtime, begun=True):
            pass  # nothing was begun
    row = store.begin_with_read(runtime, "SELECT status FROM actions WHERE action_id = %s", (action,))
    assert row == {"status": "published"}
    # Not the read's continuation: it is rolled back first, and this write commits on its own.
    with store.transaction(runtime) as cur:
        store.append_event_txn(cur, action, "note", "w1", {})
    assert runtime.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert [e["event"] for e in events(runtime, action)][-1] == "note"
    with pytest.raises(psycopg.ProgrammingError):
        with store.pipelined(runtime, begun=True):
            pass


def test_a_held_read_survives_the_session_keepers_statement(runtime, published):
    """Regression: the lease's session keeper (another thread) runs ``SELECT 1`` on the worker's
    connection; while it is in flight the transaction reads as ACTIVE, and the claim took that for a
    held read that had ended (ProgrammingError, the delivery retried). The read's continuation waits
    for the connection instead, and commits in the same transaction."""
    import threading

    action, _ = published
    assert store.begin_with_read(runtime, "SELECT status FROM actions WHERE action_id = %s", (action,))
    pid = runtime.info.backend_pid
    keeper = threading.Thread(target=lambda: runtime.execute("SELECT pg_sleep(0.5)"))
    keeper.start()
    try:
        for _ in range(200):
            if runtime.info.transaction_status == psycopg.pq.TransactionStatus.ACTIVE:
                break
            threading.Event().wait(0.005)
        assert runtime.info.transaction_status == psycopg.pq.TransactionStatus.ACTIVE
        assert store.holds_read(runtime)
        with store.pipelined(runtime, begun=True) as cur:
            cur.execute("SELECT pg_backend_pid() AS pid, txid_current_if_assigned() AS xid")
        assert cur.fetchone()["pid"] == pid
    finally:
        keeper.join()
    assert runtime.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
