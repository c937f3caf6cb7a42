"""Issue 19, item 6: recovery acts only on signed facts.

The hole: connected as the workers' database role, with no key at all, an attacker moved a verified
``ticket.create`` row back to ``recovery`` with ``finding = prohibited`` and a forged
``recovery_data.after.ticket`` naming another ticket of the same tenant; recovery then signed a
``ticket.close`` compensation of that ticket. Now every verdict commit carries the worker's signed
evidence statement, and recovery compares the row with it before it derives anything.

Everything is real: Postgres with its roles, Redis, the Celery workers of the split deployment
(``tests/security/test_signing_authority.py``: an execute worker with its worker key and no
envelope key, a recovery worker with the recovery key) and the stdio system of record.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from ledger import evidence
from ledger.states import ActionStatus, Outcome
from proofline.keys import KeyRole, load_keyring, load_signing_key
from proofline.signing import sign_evidence
from proofline_kit.sor import store as sor
from tests.conftest import Stack, role_urls, wait_for
from tests.helpers import evidence_of, recovery_action, run_of, run_settled, stale_close_env, ticket_env
from tests.security import test_signing_authority as authority
from worker.dispatch import CeleryDispatch

split = authority.split  # the split deployment (module-scoped fixture)


def worker_role(stack: Stack) -> psycopg.Connection:
    """A connection as ``proofline_worker`` itself (not the runtime role the stack's workers use)."""
    return psycopg.connect(role_urls(stack.admin_url)["worker"], autocommit=True)


def verified_ticket(stack: Stack) -> tuple[str, dict[str, Any]]:
    """A real ticket.create, verified: its action id and the worker-signed statement of it."""
    env = ticket_env(stack)
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    seals = evidence_of(stack, env.action_id, evidence.EVENT)
    assert seals, "a verified action carries the worker's signed evidence"
    return env.action_id, seals[-1]


def forge_back_to_recovery(stack: Stack, action_id: str, victim: dict[str, Any]) -> None:
    """As ``proofline_worker`` (what a compromised worker host has, without its key file): the row
    goes back to recovery, prohibited, its after-snapshot naming ``victim``."""
    with worker_role(stack) as conn:
        role = conn.execute("SELECT current_user AS u").fetchone()
        assert role is not None and role[0] == "proofline_worker"
        moved = conn.execute(
            """UPDATE actions SET status = 'recovery', finding = 'prohibited', reason_code = 'verification_failed',
                      recovery_data = jsonb_set(recovery_data, '{after}', %s) WHERE action_id = %s
               RETURNING action_id""", (Jsonb({"found": True, "ticket": victim}), action_id)).fetchall()
        assert len(moved) == 1


def assert_refused(stack: Stack, action_id: str, victim: dict[str, Any], effects_before: int, reason: str) -> dict:
    CeleryDispatch(stack.app).recover(action_id)
    stack.wait_event(action_id, "recovery_refused")
    row = stack.wait_settled(action_id)
    assert (row.status, row.reason_code) == (ActionStatus.escalated, reason)
    refused = evidence_of(stack, action_id, "recovery_refused")
    assert len(refused) == 1 and refused[0]["reason"] == reason
    assert "recovery_action_published" not in stack.events(action_id)
    with stack.conn.cursor() as cur:
        cur.execute("SELECT count(*) AS n FROM actions WHERE parent_action_id = %s OR action_id LIKE %s",
                    (action_id, f"{action_id}.%"))
        assert cur.fetchone()["n"] == 0, "a recovery action was signed and recorded"
    alerts = [e["evidence"] for e in stack.timeline("alerts:security") if e["evidence"].get("action_id") == action_id]
    assert [a["alert"] for a in alerts] == ["recovery_refused"] and alerts[0]["reason"] == reason
    assert sor.get_ticket(stack.sor_db, victim["id"])["ticket"] == victim
    assert len(sor.effects(stack.sor_db)) == effects_before
    return refused[0]


def test_the_forged_move_back_to_recovery_gets_no_compensation(split: Stack) -> None:
    action_id, _ = verified_ticket(split)
    victim = sor.get_ticket(split.sor_db, sor.put_ticket(split.sor_db, "acme", "unrelated", "finance"))["ticket"]
    before = len(sor.effects(split.sor_db))
    forge_back_to_recovery(split, action_id, victim)
    refusal = assert_refused(split, action_id, victim, before, "evidence_mismatch")
    # The refusal names the forged columns: the statement said closed, expected, and another snapshot.
    assert refusal["columns"] == "finding, recovery_data, status"
    log = (split.workdir / "worker-rec0.log").read_text(errors="replace")
    assert "security_alert recovery_refused: evidence_mismatch" in log and action_id in log


def test_evidence_signed_with_a_key_that_is_not_a_worker_key_is_refused(split: Stack) -> None:
    """An attacker who also appends a matching statement, signed with the recovery key (or an
    unknown key), is refused as unsigned: only an active worker key vouches for evidence."""
    for name, signer in (("recovery key", load_signing_key(split.settings.recovery_key_file, KeyRole.recovery)),
                         ("unknown key", None)):
        action_id, genuine = verified_ticket(split)
        victim = sor.get_ticket(split.sor_db, sor.put_ticket(split.sor_db, "acme", "unrelated", "finance"))["ticket"]
        before = len(sor.effects(split.sor_db))
        forge_back_to_recovery(split, action_id, victim)
        row = split.action(action_id)
        claims = evidence.statement(
            action_id=action_id, idempotency_key=row.idempotency_key, status=ActionStatus.recovery,
            outcome=row.outcome, finding=row.finding, reason_code=row.reason_code, result=row.result,
            recovery_data=row.recovery_data, signer="attacker")
        seal = {**genuine, "statement": claims}  # the genuine worker signature no longer covers it
        if signer is not None:
            seal = sign_evidence(claims, authority.SigningKey(signer.key_id, KeyRole.worker, signer.private))
        with worker_role(split) as conn:
            conn.execute("INSERT INTO ledger_events (action_id, event, actor, evidence) VALUES (%s, %s, 'w', %s)",
                         (action_id, evidence.EVENT, Jsonb(seal)))
        refusal = assert_refused(split, action_id, victim, before, "evidence_unsigned")
        assert refusal["cause"] == ("wrong_key_role" if signer is not None else "bad_signature"), name


def test_a_worker_key_cannot_sign_a_compensation(split: Stack) -> None:
    action_id, _ = verified_ticket(split)
    parent = split.action(action_id)
    worker = load_signing_key(split.settings.worker_key_file, KeyRole.worker)
    derived = authority._derived(split, parent)
    message = authority.sign_document(derived.model_dump(mode="json"), worker)
    before = len(sor.effects(split.sor_db))
    task_id = authority.deliver(split, message, queue="compensate")
    assert authority.refusal(split, message, task_id)["reason_code"] == "envelope_wrong_key_role"
    assert len(sor.effects(split.sor_db)) == before


def test_an_honest_failed_run_still_compensates(split: Stack) -> None:
    """A verified step whose run fails later is compensated, on the strength of its signed evidence;
    the compensation's own signed evidence closes it as compensated."""
    steps = run_of(split, [lambda **kw: ticket_env(split, **kw), lambda **kw: stale_close_env(split, **kw)])
    split.publish_run(steps)
    run_settled(split, steps[0].run_id, expect="compensated")
    assert split.action(steps[0].action_id).outcome == Outcome.compensated
    compensation = recovery_action(split, steps[0].action_id)
    ring = load_keyring(split.settings.keyring_file)
    for action_id in (steps[0].action_id, compensation):
        seal = evidence_of(split, action_id, evidence.EVENT)[-1]
        assert ring.get(seal["key_id"]).role == KeyRole.worker
    assert sor.find_ticket_by_key(split.sor_db, steps[0].idempotency_key)["ticket"]["status"] == "closed"



def test_an_honest_verification_failure_still_compensates(split: Stack) -> None:
    """The ticket's title is changed by someone else between the write and the reads: verification
    never sees the expected state (not reached), the worker signs that verdict, recovery verifies
    it and compensates by closing exactly the ticket the action created."""
    from proofline_kit.sor.db import writing

    env = ticket_env(split)
    # Every read of the ticket waits a second (the precondition read too), so the edit below lands
    # before any verification read sees the ticket.
    sor.set_fault(split.sor_db, "find_ticket_by_key", "delay", remaining=-1, delay_seconds=1.0)
    try:
        split.publish(env)
        created = wait_for(lambda: sor.find_ticket_by_key(split.sor_db, env.idempotency_key)["ticket"], 30,
                           what="the ticket to be created")
        with writing(split.sor_db) as conn:
            conn.execute("UPDATE tickets SET title = 'edited by someone else' WHERE id = ?", (created["id"],))
        split.wait_event(env.action_id, "recovery_action_published", timeout=60)
    finally:
        sor.clear_faults(split.sor_db)
    decided = evidence_of(split, env.action_id, "recovery_decided")
    assert [d["decision"] for d in decided] == ["compensation"]
    assert decided[0]["facts"]["finding"] == "not_reached"
    seal = evidence_of(split, env.action_id, evidence.EVENT)[-1]["statement"]
    assert (seal["status"], seal["finding"]) == ("recovery", "not_reached")
    assert "recovery_refused" not in split.events(env.action_id)
    parent = wait_for(lambda: (r := split.action(env.action_id)).outcome == Outcome.compensated and r, 60,
                      what="the parent to be compensated")
    assert parent.status == ActionStatus.closed
    assert sor.get_ticket(split.sor_db, created["id"])["ticket"]["status"] == "closed"
