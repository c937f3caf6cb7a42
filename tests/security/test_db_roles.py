"""The database roles of migration 0003 on a real, freshly migrated Postgres: every forbidden write
of the worker role is refused by Postgres itself (privileges or guard triggers, never Python), each
legal path still works for the role it belongs to, the reader writes nothing, and the rule tables
in the database equal their Python source (ledger/roles.py)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from ledger import reads, seal, store
from ledger.roles import ACTION_TRANSITIONS, EVENT_RIGHTS, IDEMPOTENCY_TRANSITIONS, ROLES
from ledger.states import ActionStatus, IdempotencyStatus, KillSwitchScope, Outcome
from proofline.envelope import build_envelope
from proofline.errors import PrivilegeRefused, ReadRefused
from proofline.ledger_check import check_chains
from recovery.cancel import cancel
from recovery.operator import clear_switch, resolve, set_switch
from tests.conftest import create_database, drop_database, role_urls

Denied = psycopg.errors.InsufficientPrivilege

# Stored signed messages are sealed (ledger/seal.py); a throwaway key for these role tests.
SEAL = seal.remember(seal.SealKey("seal-roles-test", os.urandom(32)))


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    admin, _ = create_database("pl_roles")
    try:
        yield {"admin": admin, **role_urls(admin)}
    finally:
        drop_database(admin)


@pytest.fixture(scope="module")
def conns(urls: dict[str, str]) -> Iterator[dict[str, psycopg.Connection]]:
    opened = {name: store.connect(url) for name, url in urls.items()}
    try:
        yield opened
    finally:
        for conn in opened.values():
            conn.close()


class Recorder:
    """Stands in for the broker in operator paths (cancel revokes the queued task)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    def revoke(self, task_id: str) -> None:
        self.sent.append(("revoke", task_id))

    def recover(self, action_id: str) -> None:
        self.sent.append(("recover", action_id))

    def execute(self, message: Any, queue: str = "actions", task_id: str | None = None) -> str:
        self.sent.append(("execute", message))
        return task_id or ""


def envelope(action_id: str | None = None, **kw: Any) -> dict[str, Any]:
    now = datetime.now(UTC)
    action_id = action_id or f"act-{uuid.uuid4().hex[:10]}"
    env = build_envelope(
        run_id=f"run-{action_id}", action_id=action_id, workflow_type="agent.ops", action_type="ticket.create",
        requester="operator@example.com", workload_identity="agent:ops-assistant", tenant="acme",
        environment="production", target={"type": "ticket_queue", "id": "support"}, operation="create",
        arguments={"tenant": "acme", "title": f"t-{action_id}", "owner": "ops"},
        server={"name": "sor", "version": "1.0.0"}, tool={"name": "create_ticket", "contract_hash": "a" * 64},
        policy_version=5, approval={"id": "apr-1", "version": 1, "expires_at": now + timedelta(hours=1)},
        timeout_seconds=5, deadline=now + timedelta(minutes=10), **kw,
    )
    return env.model_dump(mode="json")


def publish(conns: dict[str, psycopg.Connection], **kw: Any) -> dict[str, Any]:
    """The controller's legal path: the action row and its ``published`` event."""
    env = envelope(**kw)
    with store.transaction(conns["controller"]) as cur:
        assert store.insert_action_txn(cur, env, message={"envelope": env, "key_id": "k1", "signature": "sig"},
                                       seal_key=SEAL)
        store.append_event_txn(cur, env["action_id"], "published", "controller", {"n": 1})
    return env


def force(conns: dict[str, psycopg.Connection], action_id: str, status: ActionStatus,
          outcome: Outcome | None = None) -> None:
    """Arrange a state directly as the owning role (the guards trust it), for tests of what follows."""
    with store.transaction(conns["admin"]) as cur:
        cur.execute("UPDATE actions SET status = %s, outcome = %s WHERE action_id = %s",
                    (status.value, outcome.value if outcome else None, action_id))


def action(conns: dict[str, psycopg.Connection], action_id: str) -> store.ActionRow:
    with conns["reader"].cursor() as cur:
        row = store.get_action(cur, action_id)
    assert row is not None
    return row


def refused(conn: psycopg.Connection, write: Callable[[store.Cursor], Any], error: type[Exception] = PrivilegeRefused,
            sqlstate: str | None = None) -> Exception:
    with pytest.raises(error) as info:
        with store.transaction(conn) as cur:
            write(cur)
    if sqlstate is not None:
        assert info.value.context["sqlstate"] == sqlstate, info.value
    return info.value


def claim(cur: store.Cursor, env: dict[str, Any], key: str | None = None) -> tuple[bool, store.IdempotencyRecord]:
    cur.execute("SELECT nextval('lease_fencing_seq') AS t")
    token = int(cur.fetchone()["t"])
    return store.claim_idempotency_txn(cur, key=key or env["idempotency_key"], action_id=env["action_id"],
                                       tenant=env["tenant"], argument_hash="h", contract_hash="c",
                                       fencing_token=token, replay_window_seconds=3600)


# --- the worker's forbidden writes -----------------------------------------------------------------------


def test_worker_cannot_insert_an_action(conns):
    env = envelope()
    refused(conns["worker"], lambda cur: store.insert_action_txn(cur, env), Denied)
    # The development role (worker + recovery) may insert derived recovery actions only, not actions.
    err = refused(conns["runtime"], lambda cur: store.insert_action_txn(cur, env), sqlstate="PL004")
    assert "only proofline_controller publishes actions" in str(err)
    with conns["reader"].cursor() as cur:
        assert store.get_action(cur, env["action_id"]) is None


@pytest.mark.parametrize("event", ["operator_intervention", "manual_resolution", "published", "pending",
                                   "kill_switch_cleared", "cancel_requested"])
def test_worker_cannot_append_events_of_other_roles(conns, event):
    env = publish(conns)
    err = refused(conns["worker"], lambda cur: store.append_event_txn(cur, env["action_id"], event, "mallory", {}),
                  sqlstate="PL003")
    assert event in str(err)
    assert [e["event"] for e in store.timeline(conns["reader"].cursor(), env["action_id"])] == ["published"]


def test_worker_cannot_write_a_kill_switch_chain(conns):
    refused(conns["worker"], lambda cur: store.append_event_txn(cur, "killswitch:global:", "kill_switch_gone",
                                                                "mallory", {}), sqlstate="PL003")


@pytest.mark.parametrize(("start", "start_outcome", "allowed", "to", "outcome"), [
    (ActionStatus.closed, Outcome.completed_verified, ActionStatus.closed, ActionStatus.executing, None),
    (ActionStatus.published, None, ActionStatus.published, ActionStatus.closed, Outcome.completed_verified),
    (ActionStatus.executing, None, ActionStatus.executing, ActionStatus.closed, Outcome.completed_verified),
    (ActionStatus.escalated, Outcome.unknown_outcome, ActionStatus.escalated, ActionStatus.closed,
     Outcome.completed_verified),
    (ActionStatus.closed, Outcome.not_started, ActionStatus.closed, ActionStatus.recovery, None),
    (ActionStatus.cancelled, Outcome.not_started, ActionStatus.cancelled, ActionStatus.published, None),
    (ActionStatus.closed, Outcome.not_started, ActionStatus.closed, ActionStatus.closed,
     Outcome.completed_verified),
], ids=["closed-executing", "published-closed-verified", "executing-closed-verified", "escalated-closed",
        "closed-recovery-unverified", "cancelled-published", "closed-outcome-rewritten"])
def test_worker_cannot_make_an_illegal_transition(conns, start, start_outcome, allowed, to, outcome):
    env = publish(conns)
    force(conns, env["action_id"], start, start_outcome)
    before = action(conns, env["action_id"])
    err = refused(conns["runtime"], lambda cur: store.transition_txn(cur, env["action_id"], [allowed], to,
                                                                     outcome=outcome), sqlstate="PL001")
    assert "illegal action transition" in str(err) and f"{start.value} -> {to.value}" in str(err)
    assert action(conns, env["action_id"]) == before


@pytest.mark.parametrize(("column", "value"), [
    ("envelope", '{"forged": true}'), ("signature", "forged"), ("key_id", "other"), ("tenant", "globex"),
    ("idempotency_key", "pl1-forged"), ("ledger_head", "0" * 64), ("ledger_seq", "0"),
])
def test_worker_cannot_change_immutable_columns(conns, column, value):
    env = publish(conns)
    refused(conns["runtime"], lambda cur: cur.execute(f"UPDATE actions SET {column} = %s WHERE action_id = %s",
                                                      (value, env["action_id"])), Denied)


def test_worker_cannot_touch_kill_switches_or_revocations(conns):
    assert set_switch(conns["operator"], KillSwitchScope.tool, "sor:issue_refund-w", "secops", "drill")
    with store.transaction(conns["operator"]) as cur:
        store.revoke_identity_txn(cur, "agent:leaked", "secops", "leaked")
    worker = conns["runtime"]
    refused(worker, lambda cur: cur.execute("UPDATE kill_switches SET cleared_at = now(), cleared_by = 'mallory' "
                                            "WHERE value = 'sor:issue_refund-w'"), Denied)
    refused(worker, lambda cur: cur.execute("DELETE FROM kill_switches WHERE value = 'sor:issue_refund-w'"), Denied)
    refused(worker, lambda cur: cur.execute("INSERT INTO kill_switches (scope, value, set_by, reason) "
                                            "VALUES ('global', '', 'mallory', 'dos')"), Denied)
    refused(worker, lambda cur: cur.execute("DELETE FROM revoked_identities WHERE identity = 'agent:leaked'"), Denied)
    refused(worker, lambda cur: cur.execute("UPDATE revoked_identities SET identity = 'agent:other' "
                                            "WHERE identity = 'agent:leaked'"), Denied)
    refused(worker, lambda cur: store.revoke_identity_txn(cur, "secops", "mallory", "lockout"), Denied)
    with conns["reader"].cursor() as cur:
        cur.execute("SELECT count(*) AS n FROM kill_switches WHERE value = 'sor:issue_refund-w' AND cleared_at IS NULL")
        assert cur.fetchone()["n"] == 1
        cur.execute("SELECT count(*) AS n FROM revoked_identities WHERE identity = 'agent:leaked'")
        assert cur.fetchone()["n"] == 1


def test_worker_cannot_flip_an_idempotency_record(conns):
    env = publish(conns)
    key = env["idempotency_key"]
    with store.transaction(conns["runtime"]) as cur:
        _, record = claim(cur, env)
        store.update_idempotency_txn(cur, key, fencing_token=record.fencing_token,
                                     allowed=[IdempotencyStatus.in_progress], status=IdempotencyStatus.completed,
                                     result={"ticket": "T-1"})
    for status in (IdempotencyStatus.in_progress, IdempotencyStatus.unknown):
        err = refused(conns["runtime"], lambda cur, s=status: store.update_idempotency_txn(
            cur, key, fencing_token=record.fencing_token, allowed=[IdempotencyStatus.completed], status=s),
            sqlstate="PL002")
        assert f"completed -> {status.value}" in str(err)
    # Nor by hand: a lower fencing token, or immutable columns.
    refused(conns["runtime"], lambda cur: cur.execute("UPDATE idempotency_records SET fencing_token = fencing_token - 1 "
                                                      "WHERE key = %s", (key,)), sqlstate="PL002")
    refused(conns["runtime"], lambda cur: cur.execute("UPDATE idempotency_records SET argument_hash = 'x' "
                                                      "WHERE key = %s", (key,)), Denied)
    refused(conns["runtime"], lambda cur: cur.execute("DELETE FROM idempotency_records WHERE key = %s", (key,)),
            Denied)
    with conns["reader"].cursor() as cur:
        assert store.get_idempotency_txn(cur, key).status == IdempotencyStatus.completed


def test_worker_cannot_claim_a_key_no_published_action_holds(conns):
    env = publish(conns)
    refused(conns["runtime"], lambda cur: claim(cur, env, key="pl1-" + "f" * 64), sqlstate="PL002")
    other = envelope()  # never published
    refused(conns["runtime"], lambda cur: claim(cur, other), sqlstate="PL002")


@pytest.mark.parametrize("statement", ["UPDATE ledger_events SET actor = 'mallory' WHERE action_id = %s",
                                       "DELETE FROM ledger_events WHERE action_id = %s"], ids=["update", "delete"])
def test_worker_cannot_change_ledger_events(conns, statement):
    env = publish(conns)
    refused(conns["runtime"], lambda cur: cur.execute(statement, (env["action_id"],)), Denied)


def test_worker_cannot_hide_an_action_from_the_reconciler(conns):
    env = publish(conns)
    refused(conns["runtime"], lambda cur: cur.execute(
        "UPDATE actions SET next_check_at = now() + interval '1 year' WHERE action_id = %s", (env["action_id"],)),
        sqlstate="PL005")


# --- the legal paths ----------------------------------------------------------------------------------


def test_worker_runs_the_legal_path_and_the_chain_head_follows(conns):
    env = publish(conns)
    aid, key = env["action_id"], env["idempotency_key"]
    with store.transaction(conns["worker"]) as cur:
        claimed, record = claim(cur, env)
        assert claimed
        store.append_events_txn(cur, aid, "w1", [("validated", {}), ("idempotency_claimed", {})])
        store.transition_txn(cur, aid, [ActionStatus.published], ActionStatus.executing)
    with store.transaction(conns["worker"]) as cur:
        store.update_idempotency_txn(cur, key, fencing_token=record.fencing_token,
                                     allowed=[IdempotencyStatus.in_progress], status=IdempotencyStatus.completed)
        store.append_event_txn(cur, aid, "tool_called", "w1", {"outcome": "completed_unverified"})
        store.transition_txn(cur, aid, [ActionStatus.executing], ActionStatus.verifying,
                             outcome=Outcome.completed_unverified, reason_code="ok")
    with store.transaction(conns["worker"]) as cur:
        store.settle_idempotency_txn(cur, key, IdempotencyStatus.completed, {"verified": "expected"})
        store.append_event_txn(cur, aid, "verification_finished", "w1", {"finding": "expected"})
        row = store.transition_txn(cur, aid, [ActionStatus.verifying], ActionStatus.closed,
                                   outcome=Outcome.completed_verified, finding="expected", reason_code="verified")
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    timeline = store.timeline(conns["reader"].cursor(), aid)
    with conns["reader"].cursor() as cur:
        cur.execute("SELECT ledger_seq, ledger_head FROM actions WHERE action_id = %s", (aid,))
        head = cur.fetchone()
    # The chain trigger anchored the head as the owner: the worker holds no right on those columns.
    assert (head["ledger_seq"], head["ledger_head"]) == (len(timeline), timeline[-1]["hash"])
    assert check_chains(conns["reader"])[2] == []


def test_reconciler_bookkeeping_is_not_a_transition(conns):
    env = publish(conns)
    force(conns, env["action_id"], ActionStatus.closed, Outcome.completed_verified)
    before = action(conns, env["action_id"])
    with store.transaction(conns["worker"]) as cur:
        cur.execute("""UPDATE actions SET next_check_at = clock_timestamp() + interval '1 minute',
                              recovery_data = jsonb_set(recovery_data, '{redrives}', '1') WHERE action_id = %s""",
                    (env["action_id"],))
    after = action(conns, env["action_id"])
    assert after.recovery_data == {"redrives": 1} and after.updated_at == before.updated_at
    refused(conns["worker"], lambda cur: cur.execute(
        """UPDATE actions SET recovery_data = recovery_data || '{"before": {"forged": true}}' WHERE action_id = %s""",
        (env["action_id"],)), sqlstate="PL001")


def test_controller_publishes_and_cannot_go_further(conns):
    env = publish(conns)
    aid = env["action_id"]
    controller = conns["controller"]
    refused(controller, lambda cur: store.transition_txn(cur, aid, [ActionStatus.published], ActionStatus.executing),
            Denied)
    refused(controller, lambda cur: store.append_event_txn(cur, aid, "validated", "controller", {}),
            sqlstate="PL003")
    refused(controller, lambda cur: store.insert_action_txn(cur, envelope(), status=ActionStatus.closed),
            sqlstate="PL004")
    other = envelope()
    refused(controller, lambda cur: store.insert_action_txn(cur, other, kind="compensation", parent_action_id=aid),
            sqlstate="PL004")
    with store.transaction(controller) as cur:  # a run's later step, held
        assert store.insert_action_txn(cur, other, status=ActionStatus.pending)
        store.append_event_txn(cur, other["action_id"], "pending", "controller", {})
    assert action(conns, aid).status == ActionStatus.published


def test_a_gateway_read_is_asked_by_the_controller_and_answered_by_a_worker_only(conns):
    request = {"request_id": f"rd-{uuid.uuid4().hex}", "tenant": "acme", "action_type": "ticket.close",
               "target": {"type": "ticket", "id": "t-1"}}
    chain = f"read:{request['request_id']}"
    for role in ("worker", "operator", "reader"):  # nobody but a controller asks for a read
        refused(conns[role], lambda cur, r=role: reads.request_txn(cur, request, r),
                Denied if role == "reader" else PrivilegeRefused)
    with store.transaction(conns["controller"]) as cur:
        reads.request_txn(cur, request, "gateway:ops")
    for role in ("controller", "operator"):  # nobody but a worker answers one
        err = refused(conns[role], lambda cur, r=role: reads.answer_txn(cur, request["request_id"], {"found": True}, r),
                      sqlstate="PL003")
        assert "read_answered" in str(err)
    with store.transaction(conns["worker"]) as cur:
        reads.answer_txn(cur, request["request_id"], {"found": True, "value": {"v": 1}}, "w1")
    # Answered once: a second delivery of the same task writes nothing.
    refused(conns["worker"], lambda cur: reads.answer_txn(cur, request["request_id"], {"found": False}, "w1"),
            ReadRefused)
    assert [e["event"] for e in store.timeline(conns["reader"].cursor(), chain)] == ["read_requested",
                                                                                      "read_answered"]


def test_recovery_publishes_a_derived_action_for_a_parent_in_recovery_only(conns):
    parent = publish(conns)
    derived = envelope(f"{parent['action_id']}.compensation")

    def insert(cur: store.Cursor) -> None:
        store.insert_action_txn(cur, derived, kind="compensation", parent_action_id=parent["action_id"])
        store.append_event_txn(cur, derived["action_id"], "published", "recovery", {})

    refused(conns["recovery"], insert, sqlstate="PL004")  # the parent is not in recovery
    force(conns, parent["action_id"], ActionStatus.recovery, Outcome.failed_after_side_effect)
    refused(conns["worker"], insert, Denied)  # the worker alone never publishes
    with store.transaction(conns["recovery"]) as cur:
        insert(cur)
    row = action(conns, derived["action_id"])
    assert (row.kind, row.parent_action_id, row.status) == ("compensation", parent["action_id"],
                                                            ActionStatus.published)
    # "published" stays the controller's on an ordinary action's chain.
    refused(conns["recovery"], lambda cur: store.append_event_txn(cur, parent["action_id"], "published", "r", {}),
            sqlstate="PL003")


def test_containment_engages_only_for_an_action_in_recovery(conns):
    env = publish(conns)
    refused(conns["worker"], lambda cur: store.contain_txn(cur, env["action_id"], "w1", "why"), sqlstate="PL004")
    force(conns, env["action_id"], ActionStatus.recovery, Outcome.failed_after_side_effect)
    with store.transaction(conns["worker"]) as cur:
        assert store.contain_txn(cur, env["action_id"], "w1", "contain") is True
        assert store.contain_txn(cur, env["action_id"], "w1", "contain") is False  # already active
    chain = "killswitch:tool_tenant:sor:create_ticket@acme"
    assert [e["event"] for e in store.timeline(conns["reader"].cursor(), chain)][-1] == "kill_switch_set"
    assert clear_switch(conns["operator"], KillSwitchScope.tool_tenant, "sor:create_ticket@acme", "ops", "done")


def test_operator_sets_and_clears_kill_switches_and_resolves(conns):
    operator = conns["operator"]
    assert set_switch(operator, KillSwitchScope.tenant, "globex", "secops", "drill") is True
    assert set_switch(operator, KillSwitchScope.tenant, "globex", "secops", "drill") is False
    assert clear_switch(operator, KillSwitchScope.tenant, "globex", "secops", "over") is True
    # A cleared switch stays cleared: it is not re-armed or re-dated by hand.
    refused(operator, lambda cur: cur.execute("UPDATE kill_switches SET cleared_at = NULL, cleared_by = NULL "
                                              "WHERE value = 'globex'"), sqlstate="PL005")
    events = [e["event"] for e in store.timeline(conns["reader"].cursor(), "killswitch:tenant:globex")]
    assert events == ["kill_switch_set", "kill_switch_cleared"]

    env = publish(conns)
    force(conns, env["action_id"], ActionStatus.escalated, Outcome.unknown_outcome)
    resolve(operator, env["action_id"], "no_effect", "oncall", "checked by hand", {"ticket": None})
    row = action(conns, env["action_id"])
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.failed_before_side_effect,
                                                          "operator_no_effect")
    # The operator resolves escalations only: not a verified action into something else.
    refused(operator, lambda cur: store.transition_txn(cur, env["action_id"], [ActionStatus.closed],
                                                       ActionStatus.closed, outcome=Outcome.completed_verified),
            sqlstate="PL001")


def test_operator_cancels_a_published_action(conns):
    env = publish(conns)
    broker = Recorder()
    with store.transaction(conns["admin"]) as cur:
        cur.execute("UPDATE actions SET task_id = 'task-1' WHERE action_id = %s", (env["action_id"],))
    result = cancel(conns["operator"], broker, env["action_id"], "ops@example.com", "wrong customer")
    assert result["accepted"] and result["disposition"] == "cancelled"
    assert ("revoke", "task-1") in broker.sent
    row = action(conns, env["action_id"])
    assert (row.status, row.outcome) == (ActionStatus.cancelled, Outcome.not_started)
    # Once requested, a cancellation is not rewritten, and never by the worker.
    refused(conns["operator"], lambda cur: cur.execute("UPDATE actions SET cancel_reason = 'other' "
                                                       "WHERE action_id = %s", (env["action_id"],)), sqlstate="PL005")
    refused(conns["runtime"], lambda cur: cur.execute("UPDATE actions SET cancel_requested_at = now() "
                                                      "WHERE action_id = %s", (env["action_id"],)), Denied)


@pytest.mark.parametrize("statement", [
    "INSERT INTO ledger_events (action_id, event, actor) VALUES ('x', 'validated', 'r')",
    "UPDATE actions SET status = 'closed'",
    "INSERT INTO kill_switches (scope, value, set_by, reason) VALUES ('global', '', 'r', 'r')",
    "UPDATE kill_switches SET cleared_at = now(), cleared_by = 'r'",
    "INSERT INTO revoked_identities (identity, revoked_by, reason) VALUES ('x', 'r', 'r')",
    "UPDATE idempotency_records SET status = 'completed'",
    "UPDATE leases SET released_at = now()",
    "DELETE FROM actions",
    "UPDATE action_transitions SET roles = ARRAY['reader']",
    "INSERT INTO ledger_event_rights (event, roles) VALUES ('x', ARRAY['reader'])",
    "SELECT proofline_contain('x', 'r', 'r')",
    "SELECT * FROM proofline_transition((SELECT min(action_id) FROM actions), ARRAY['published']::action_status[], "
    "'closed', 'completed_verified', NULL, NULL, NULL, '{}', NULL, 'r', '[]')",
], ids=["event", "actions", "kill-insert", "kill-clear", "revoke", "idem", "leases", "delete", "rules",
        "rights", "contain", "transition"])
def test_reader_cannot_write_anything(conns, statement):
    refused(conns["reader"], lambda cur: cur.execute(statement), Denied)


def test_reader_reads_and_verifies_the_ledger(conns):
    publish(conns)
    chains, events, broken = check_chains(conns["reader"])
    assert chains >= 1 and events >= 1 and broken == []


def test_no_role_may_change_the_rules(conns):
    for role in ("runtime", "worker", "recovery", "operator", "controller"):
        refused(conns[role], lambda cur: cur.execute("DELETE FROM action_transitions"), Denied)
        refused(conns[role], lambda cur: cur.execute("ALTER TABLE actions DISABLE TRIGGER actions_guard"), Denied)
        # Nor shadow them: no temporary tables, no objects in public (the guards read public's tables).
        refused(conns[role], lambda cur: cur.execute("CREATE TEMP TABLE action_transitions (x int)"), Denied)
        refused(conns[role], lambda cur: cur.execute("CREATE TABLE public.shadow (x int)"), Denied)


# --- the roles and rules as installed ----------------------------------------------------------------


def test_role_memberships(conns):
    with conns["admin"].cursor() as cur:
        cur.execute("""SELECT r.rolname AS role, array_agg(m.rolname ORDER BY m.rolname) AS member_of
                       FROM pg_roles r LEFT JOIN pg_auth_members a ON a.member = r.oid
                       LEFT JOIN pg_roles m ON m.oid = a.roleid
                       WHERE r.rolname LIKE 'proofline\\_%%' GROUP BY r.rolname""")
        members = {r["role"]: [m for m in r["member_of"] if m] for r in cur.fetchall()}
    assert members["proofline_runtime"] == ["proofline_recovery", "proofline_worker"]
    assert members["proofline_recovery"] == ["proofline_worker"]
    for role in ("proofline_controller", "proofline_worker", "proofline_operator", "proofline_reader"):
        assert members[role] == [], role
    assert set(ROLES) <= set(members)


def test_definer_functions_are_pinned_and_not_public(conns):
    with conns["admin"].cursor() as cur:
        cur.execute("""SELECT proname, prosecdef, proconfig FROM pg_proc
                       WHERE proname IN ('ledger_chain', 'proofline_contain')""")
        rows = {r["proname"]: r for r in cur.fetchall()}
        for name in ("ledger_chain", "proofline_contain"):
            assert rows[name]["prosecdef"] is True
            assert rows[name]["proconfig"] == ["search_path=public, pg_temp"]
        cur.execute("""SELECT has_function_privilege('proofline_reader', 'proofline_contain(text, text, text)',
                                                     'EXECUTE') AS reader,
                              has_function_privilege('proofline_controller', 'proofline_contain(text, text, text)',
                                                     'EXECUTE') AS controller""")
        assert cur.fetchone() == {"reader": False, "controller": False}


def test_rule_tables_equal_their_python_source(conns):
    with conns["reader"].cursor() as cur:
        cur.execute("SELECT from_status::text, to_status::text, roles, keeps_outcome, outcomes, from_outcomes "
                    "FROM action_transitions")
        db = {(r["from_status"], r["to_status"]): (tuple(r["roles"]), r["keeps_outcome"], tuple(r["outcomes"]),
                                                   tuple(r["from_outcomes"]) if r["from_outcomes"] else None)
              for r in cur.fetchall()}
        cur.execute("SELECT from_status::text AS a, to_status::text AS b FROM idempotency_transitions")
        idem = {(r["a"], r["b"]) for r in cur.fetchall()}
        cur.execute("SELECT event, roles FROM ledger_event_rights")
        rights = {r["event"]: tuple(r["roles"]) for r in cur.fetchall()}
    assert db == {(t.from_status, t.to_status): (t.roles, t.keeps_outcome, t.outcomes, t.from_outcomes)
                  for t in ACTION_TRANSITIONS}
    assert idem == set(IDEMPOTENCY_TRANSITIONS)
    assert rights == dict(EVENT_RIGHTS)
    statuses = {s.value for s in ActionStatus}
    outcomes = {o.value for o in Outcome}
    for t in ACTION_TRANSITIONS:
        assert {t.from_status, t.to_status} <= statuses
        assert set(t.outcomes) | set(t.from_outcomes or ()) <= outcomes
    assert {s for pair in IDEMPOTENCY_TRANSITIONS for s in pair} <= {s.value for s in IdempotencyStatus}
