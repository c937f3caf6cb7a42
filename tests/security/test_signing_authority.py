"""Who can mint authority. Issue 7: a stdio tool server stole the (symmetric) signing key every
worker held and pushed a forged message; the worker's DB role forged an ``actions`` row that
recovery turned into a compensation signed with the real key.

The deployment here is split as in production: an execute worker whose keys directory holds only
public material (the keyring) and a recovery worker that also holds the recovery key. The test
process is the controller. Everything is real: Postgres, Redis, Celery workers, the stdio system of
record. What must hold:

- a message signed with anything a worker host holds (the keyring's public keys, the recovery key
  for a fresh action, an HMAC under any old key, a revoked or expired key) is refused and recorded,
  and nothing is called;
- a forged ``actions`` row gets no compensation: recovery refuses it, escalates it, raises the
  alert, signs nothing, and the other tenant's ticket is untouched;
- a derived envelope whose parent link is wrong is refused by the executing worker;
- rotation with overlap: the old key verifies until ``not_after``, the new one signs.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from psycopg.types.json import Jsonb

from ledger import store
from ledger.states import ActionStatus, Outcome
from proofline.canonical import canonical_bytes
from proofline.controller import publish_message, send_message
from proofline.envelope import Envelope
from proofline.keys import KeyRole, SigningKey, load_keyring, load_signing_key, new_signing_key, rotate
from proofline.signing import message_hash, sign, sign_document
from proofline_kit.sor import store as sor
from tests.conftest import Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import recovery_action, run_of, run_settled, stale_close_env, ticket_env
from worker.dispatch import CeleryDispatch
from worker.validate import refusal_chain_id

OLD_DEV_SECRET = b"proofline-development-key"  # the former default HMAC key, public in the old README


def _link_dir(source: Path, target: Path, names: list[str]) -> Path:
    """A keys directory holding only ``names``, as symlinks, so keyring edits reach every process."""
    target.mkdir(mode=0o700)
    for name in names:
        os.symlink(source / name, target / name)
    return target


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = build_stack("stdio", tmp_path_factory.mktemp("split"))
    try:
        keys = Path(stack.env["PROOFLINE_KEYS_DIR"])
        public = ["keyring.json", "ledger.key", "seal.key"]
        execute_keys = _link_dir(keys, stack.workdir / "keys-execute", [*public, "worker.key"])
        recovery_keys = _link_dir(keys, stack.workdir / "keys-recovery", [*public, "recovery.key"])
        start_workers(stack, role="execute", name="exec", beat=False,
                      env={**stack.env, "PROOFLINE_KEYS_DIR": str(execute_keys)})
        start_workers(stack, role="recovery", name="rec", env={**stack.env, "PROOFLINE_KEYS_DIR": str(recovery_keys)})
        yield stack
    finally:
        teardown_stack(stack)


# --- helpers ------------------------------------------------------------------------------------


def keys_dir(stack: Stack) -> Path:
    return Path(stack.env["PROOFLINE_KEYS_DIR"])


def controller_key(stack: Stack) -> SigningKey:
    return load_signing_key(stack.settings.signing_key_file, KeyRole.controller)


def recovery_key(stack: Stack) -> SigningKey:
    return load_signing_key(stack.settings.recovery_key_file, KeyRole.recovery)


def deliver(stack: Stack, message: Any, queue: str = "actions") -> str:
    return send_message(stack.app, message, queue=queue)


def refusal(stack: Stack, message: Any, task_id: str, timeout: float = 20.0) -> dict[str, Any]:
    chain = refusal_chain_id(message)

    def find() -> dict[str, Any] | None:
        for event in stack.timeline(chain):
            if event["event"] == "envelope_refused" and event["evidence"].get("task_id") == task_id:
                return event["evidence"]
        return None

    return wait_for(find, timeout, what=f"a refusal on {chain}")


def effects_total(stack: Stack) -> int:
    return len(sor.effects(stack.sor_db))


def add_keyring_entry(stack: Stack, role: KeyRole, **entry: Any) -> SigningKey:
    """A new key of ``role`` in the shared keyring (as an operator would add it), returned to sign with."""
    key_file, ring_entry = new_signing_key(role)
    path = stack.settings.keyring_file
    ring = json.loads(path.read_text())
    ring["keys"].append({**ring_entry, **entry})
    tmp = path.with_name(f".{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(ring))
    os.replace(tmp, path)
    seed = base64.b64decode(key_file["private_key"])
    return SigningKey(key_file["key_id"], role, Ed25519PrivateKey.from_private_bytes(seed))


def hmac_message(document: dict[str, Any], key_id: str, secret: bytes) -> dict[str, Any]:
    return {"envelope": document, "key_id": key_id,
            "signature": hmac.new(secret, canonical_bytes(document), hashlib.sha256).hexdigest()}


def worker_db(stack: Stack) -> psycopg.Connection:
    """A connection as the workers' own database role (what a compromised worker host has)."""
    return psycopg.connect(stack.env["PROOFLINE_DATABASE_URL"], autocommit=True)


def insert_forged_row(stack: Stack, env: Envelope, *, action_id: str, key_id: str | None, signature: str | None,
                      recovery_data: dict[str, Any], status: str = "recovery", tenant: str | None = None) -> None:
    """Forge an ``actions`` row. The workers' own role is refused by Postgres (docs/concepts/database-roles.md); the row is then written with the table owner's rights, an attacker with more than a
    worker host holds, so that the signature checks in recovery are what is tested."""
    sql = """INSERT INTO actions (action_id, run_id, step, tenant, action_type, server, tool, idempotency_key,
                                  status, outcome, finding, envelope, recovery_data, deadline, key_id, signature)
             VALUES (%s, %s, 0, %s, %s, %s, %s, %s, %s, 'failed_after_side_effect', 'prohibited', %s, %s, %s,
                     %s, %s)"""
    params = (action_id, env.run_id, tenant or env.tenant, env.action_type, env.server.name, env.tool.name,
              env.idempotency_key, status, Jsonb(env.model_dump(mode="json")), Jsonb(recovery_data), env.deadline,
              key_id, signature)
    with worker_db(stack) as conn, pytest.raises(psycopg.Error):
        conn.execute(sql, params)
    with psycopg.connect(stack.admin_url, autocommit=True) as conn:
        conn.execute(sql, params)


def victim_ticket(stack: Stack) -> dict[str, Any]:
    ticket_id = sor.put_ticket(stack.sor_db, "globex", "payroll run", "finance")
    return sor.get_ticket(stack.sor_db, ticket_id)["ticket"]


# --- messages signed with what a worker host holds ---------------------------------------------------


def test_the_execute_worker_holds_no_private_key(split: Stack) -> None:
    """No key that signs an envelope: its own worker key signs evidence only."""
    execute_keys = split.workdir / "keys-execute"
    assert sorted(p.name for p in execute_keys.iterdir()) == ["keyring.json", "ledger.key", "seal.key", "worker.key"]
    assert json.loads((execute_keys / "worker.key").read_text())["role"] == "worker"
    ring = json.loads((execute_keys / "keyring.json").read_text())
    assert all(set(e) >= {"key_id", "role", "public_key"} and "private_key" not in e for e in ring["keys"])


def test_messages_signed_with_worker_material_are_refused_and_nothing_is_called(split: Stack) -> None:
    controller, recovery = controller_key(split), recovery_key(split)
    ring = load_keyring(split.settings.keyring_file)
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    public = ring.get(controller.key_id).public.public_bytes(Encoding.Raw, PublicFormat.Raw)
    as_seed = SigningKey(controller.key_id, KeyRole.controller, Ed25519PrivateKey.from_private_bytes(public))
    forgeries = {
        "public key used as a signing seed": (lambda doc: sign_document(doc, as_seed), "envelope_bad_signature"),
        "public key used as an HMAC secret": (lambda doc: hmac_message(doc, controller.key_id, public),
                                              "envelope_bad_signature"),
        "recovery key on a fresh action": (lambda doc: sign_document(doc, recovery), "envelope_wrong_key_role"),
        "HMAC with the old development key id": (lambda doc: hmac_message(doc, "dev-1", OLD_DEV_SECRET),
                                                 "envelope_unknown_key"),
        "HMAC with the old key under the live key id": (
            lambda doc: hmac_message(doc, controller.key_id, OLD_DEV_SECRET), "envelope_bad_signature"),
    }
    before = effects_total(split)
    for name, (forge, code) in forgeries.items():
        env = ticket_env(split)
        message = forge(env.model_dump(mode="json"))
        evidence = refusal(split, message, deliver(split, message))
        assert evidence["reason_code"] == code, (name, evidence)
        assert evidence["claimed"]["action_id"] == env.action_id
        assert split.effects(env.idempotency_key) == 0, name
        assert split.action(env.action_id) is None, name  # no action row: nothing was started
    assert effects_total(split) == before
    # The same stack still executes what the controller signs.
    good = ticket_env(split)
    split.publish(good)
    assert split.wait_settled(good.action_id).outcome == Outcome.completed_verified


@pytest.mark.parametrize(("entry", "code"), [({"revoked": True}, "envelope_key_revoked"),
                                             ({"not_after": "2020-01-01T00:00:00+00:00"}, "envelope_key_expired")],
                         ids=["revoked", "expired"])
def test_revoked_and_expired_keys_are_refused(split: Stack, entry: dict[str, Any], code: str) -> None:
    key = add_keyring_entry(split, KeyRole.controller, **entry)
    env = ticket_env(split)
    message = sign(env, key)
    evidence = refusal(split, message, deliver(split, message))
    assert evidence["reason_code"] == code and evidence["key_id"] == key.key_id
    assert split.effects(env.idempotency_key) == 0
    assert split.action(env.action_id) is None


# --- recovery authority ------------------------------------------------------------------------------


def test_a_real_compensation_is_signed_by_recovery_and_linked_to_its_parent(split: Stack) -> None:
    steps = run_of(split, [lambda **kw: ticket_env(split, **kw), lambda **kw: stale_close_env(split, **kw)])
    split.publish_run(steps)
    run_settled(split, steps[0].run_id, expect="compensated")
    parent = split.action(steps[0].action_id)
    assert parent.outcome == Outcome.compensated
    compensation = split.action(recovery_action(split, parent.action_id))
    assert compensation.key_id == recovery_key(split).key_id
    assert compensation.envelope["parent_message_hash"] == message_hash(parent.signed_message)
    validated = next(e for e in split.timeline(compensation.action_id) if e["event"] == "validated")["evidence"]
    assert validated["parent_link"] == {"parent": parent.action_id, "kind": "compensation",
                                        "parent_message_hash": message_hash(parent.signed_message),
                                        "parent_action_type": parent.action_type}
    assert sor.find_ticket_by_key(split.sor_db, steps[0].idempotency_key)["ticket"]["status"] == "closed"


def _forged_variants(split: Stack, genuine: dict[str, Any]) -> dict[str, tuple[dict[str, Any], str]]:
    """name -> (row fields, expected refusal reason)."""
    env = ticket_env(split)  # built, never published
    doc = env.model_dump(mode="json")
    return {
        "unsigned": ({"env": env, "key_id": None, "signature": None}, "parent_signature_invalid"),
        "random signature": ({"env": env, "key_id": controller_key(split).key_id,
                              "signature": base64.b64encode(secrets.token_bytes(64)).decode()},
                             "parent_signature_invalid"),
        "HMAC under the old key": ({"env": env, **{k: v for k, v in hmac_message(doc, "dev-1", OLD_DEV_SECRET).items()
                                                   if k != "envelope"}}, "parent_signature_invalid"),
        # A genuine signed message (any worker sees them on the broker) under a new action id.
        "genuine message, other row": ({"env": Envelope.model_validate(genuine["envelope"]),
                                        "key_id": genuine["key_id"], "signature": genuine["signature"],
                                        "tenant": "globex"}, "parent_row_mismatch"),
    }


def test_a_forged_actions_row_gets_no_compensation(split: Stack) -> None:
    genuine_env = ticket_env(split)
    split.publish(genuine_env)
    split.wait_settled(genuine_env.action_id)
    genuine = split.action(genuine_env.action_id).signed_message
    for name, (fields, reason) in _forged_variants(split, genuine).items():
        victim = victim_ticket(split)
        before = effects_total(split)
        forged_id = f"forged-{uuid.uuid4().hex[:10]}"
        after = {"found": True, "ticket": victim}  # "verification saw" the other tenant's ticket
        insert_forged_row(split, fields["env"], action_id=forged_id, key_id=fields["key_id"],
                          signature=fields["signature"], recovery_data={"after": after}, tenant=fields.get("tenant"))
        CeleryDispatch(split.app).recover(forged_id)
        split.wait_event(forged_id, "recovery_refused")
        row = split.wait_settled(forged_id)
        assert (row.status, row.reason_code) == (ActionStatus.escalated, reason), name
        refused = [e for e in split.timeline(forged_id) if e["event"] == "recovery_refused"]
        assert len(refused) == 1 and refused[0]["evidence"]["reason"] == reason, name
        assert "recovery_action_published" not in split.events(forged_id)
        alerts = [e["evidence"] for e in split.timeline("alerts:security") if e["evidence"]["action_id"] == forged_id]
        assert len(alerts) == 1 and alerts[0]["alert"] == "recovery_refused", name
        with split.conn.cursor() as cur:
            cur.execute("SELECT count(*) AS n FROM actions WHERE parent_action_id = %s OR action_id LIKE %s",
                        (forged_id, f"{forged_id}.%"))
            assert cur.fetchone()["n"] == 0, f"{name}: a recovery action was created"
        assert sor.get_ticket(split.sor_db, victim["id"])["ticket"] == victim, name
        assert effects_total(split) == before, name
    log = (split.workdir / "worker-rec0.log").read_text(errors="replace")
    assert "ERROR" in log and "security_alert recovery_refused" in log and forged_id in log


def test_a_forged_recovery_row_cannot_settle_its_parent(split: Stack) -> None:
    """While a real compensation runs (its call delayed), a forged rollback row naming the same parent,
    already 'closed, completed_verified', is swept by the reconciler: it must not close the parent as
    compensated. Only the real compensation does."""
    steps = run_of(split, [lambda **kw: ticket_env(split, **kw), lambda **kw: stale_close_env(split, **kw)])
    sor.set_fault(split.sor_db, "close_ticket", "delay", remaining=1, delay_seconds=4.0)
    try:
        split.publish_run(steps)
        parent_id = steps[0].action_id
        split.wait_event(parent_id, "recovery_action_published", timeout=60)
        parent = split.action(parent_id)
        forged = _derived(split, parent, kind="rollback")
        insert_forged_row(split, forged, action_id=forged.action_id, key_id=recovery_key(split).key_id,
                          signature=base64.b64encode(secrets.token_bytes(64)).decode(), recovery_data={},
                          status="closed")
        with psycopg.connect(split.admin_url, autocommit=True) as conn:  # beyond the worker role's rights
            conn.execute("""UPDATE actions SET kind = 'rollback', parent_action_id = %s, outcome = 'completed_verified',
                                   updated_at = clock_timestamp() - interval '10 seconds' WHERE action_id = %s""",
                         (parent_id, forged.action_id))
        run_settled(split, steps[0].run_id, expect="compensated")
    finally:
        sor.clear_faults(split.sor_db)
    compensated = [e["evidence"] for e in split.timeline(parent_id) if e["event"] == "compensated"]
    assert [e["recovery_action"] for e in compensated] == [recovery_action(split, parent_id)]
    assert recovery_action(split, parent_id) != forged.action_id
    # The reconciler did meet the forged row while the parent was in recovery, and refused it.
    assert "settlement_refused" in split.events(forged.action_id)
    alerts = [e["evidence"] for e in split.timeline("alerts:security") if e["evidence"]["action_id"] == forged.action_id]
    assert [a["alert"] for a in alerts] == ["settlement_refused"]


def _derived(split: Stack, parent: Any, *, kind: str = "compensation", tenant: str = "acme",
             action_type: str = "ticket.close", link: str | None = None, recovers: str | None = None,
             target: dict[str, Any] | None = None) -> Envelope:
    """A recovery envelope as the recovery process builds one, with one thing changed."""
    ticket = sor.find_ticket_by_key(split.sor_db, parent.idempotency_key)["ticket"]
    target = target or {"type": "ticket", "id": ticket["id"], "expected_version": ticket["version"]}
    arguments = ({"ticket_id": target["id"], "expected_version": target["expected_version"]}
                 if action_type == "ticket.close" else {"refund_id": "R-1", "account": "acct-1"})
    if action_type == "refund.reverse":
        target = {"type": "refund", "id": "R-1"}
    recovers = recovers or parent.action_id
    return split.envelope(action_type, tenant=tenant, run_id=f"{parent.run_id}/recovery",
                          action_id=f"{recovers}.{kind}", arguments=arguments, target=target,
                          requester="proofline:recovery", workload_identity="proofline:recovery", recovers=recovers,
                          parent_message_hash=link or message_hash(parent.signed_message))


def test_a_derived_envelope_with_a_wrong_parent_link_is_refused(split: Stack) -> None:
    parent_env = ticket_env(split)
    split.publish(parent_env)
    split.wait_settled(parent_env.action_id)
    parent = split.action(parent_env.action_id)
    ticket_before = sor.find_ticket_by_key(split.sor_db, parent.idempotency_key)["ticket"]
    victim = victim_ticket(split)
    forged_parent_id = f"forged-{uuid.uuid4().hex[:10]}"
    forged_env = ticket_env(split, action_id=forged_parent_id)
    insert_forged_row(split, forged_env, action_id=forged_parent_id, key_id=controller_key(split).key_id,
                      signature=base64.b64encode(secrets.token_bytes(64)).decode(), recovery_data={}, status="closed")
    forged_parent = split.action(forged_parent_id)
    recovery = recovery_key(split)
    cases = {
        "hash of another message": (lambda: _derived(split, parent, link="0" * 64), "parent_hash_mismatch"),
        "parent not recorded": (lambda: _derived(split, parent, recovers=f"nope-{uuid.uuid4().hex[:8]}"),
                                "parent_missing"),
        "another tenant's ticket": (lambda: _derived(split, parent, tenant="globex", target={
            "type": "ticket", "id": victim["id"], "expected_version": victim["version"]}), "tenant_mismatch"),
        "type the contract does not declare": (lambda: _derived(split, parent, action_type="refund.reverse"),
                                               "recovery_not_declared"),
        "kind the contract does not declare": (lambda: _derived(split, parent, kind="rollback"),
                                               "recovery_not_declared"),
        "parent row with a forged signature": (lambda: _derived(split, forged_parent, target={
            "type": "ticket", "id": victim["id"], "expected_version": victim["version"]}), "parent_signature_invalid"),
    }
    for name, (build, reason) in cases.items():
        env = build()
        message = sign(env, recovery)
        evidence = refusal(split, message, deliver(split, message, queue="compensate"))
        assert (evidence["reason_code"], evidence["reason"]) == ("envelope_parent_link_invalid", reason), name
        assert split.effects(env.idempotency_key) == 0, name
    # A controller key may not sign a derived envelope, even with a correct link.
    env = _derived(split, parent)
    message = sign_document(env.model_dump(mode="json"), controller_key(split))
    assert refusal(split, message, deliver(split, message, queue="compensate"))["reason_code"] == \
        "envelope_wrong_key_role"
    assert sor.get_ticket(split.sor_db, victim["id"])["ticket"] == victim
    assert sor.find_ticket_by_key(split.sor_db, parent.idempotency_key)["ticket"] == ticket_before
    # Control: the same envelope, recovery-signed with the correct link, executes.
    good = _derived(split, parent)
    # (Recorded with the owner's rights: the roles let recovery publish a compensation only for a
    # parent in recovery, and this parent is not; the worker's link check is what is shown here.)
    with store.connect(split.admin_url) as owner:
        publish_message(owner, CeleryDispatch(split.app), sign(good, recovery), good, queue="compensate",
                        kind="compensation", parent_action_id=parent.action_id, settings=split.settings,
                        seal_key=split.seal_key)
    assert split.wait_settled(good.action_id).outcome == Outcome.completed_verified
    assert sor.find_ticket_by_key(split.sor_db, parent.idempotency_key)["ticket"]["status"] == "closed"


# --- rotation ----------------------------------------------------------------------------------------


def test_key_rotation_with_overlap(split: Stack) -> None:
    """Messages signed before the rotation verify until the old key's not_after; the new key signs."""
    old_id = controller_key(split).key_id
    in_overlap, after_overlap = ticket_env(split), ticket_env(split)
    early = {e.action_id: split.message(e) for e in (in_overlap, after_overlap)}
    overlap = 6.0
    rotated_at = time.monotonic()
    assert rotate(keys_dir(split), KeyRole.controller, timedelta(seconds=overlap))[0] == old_id
    new_id = controller_key(split).key_id
    assert new_id != old_id
    fresh = ticket_env(split)
    split.publish(fresh)
    publish_message(split.conn, CeleryDispatch(split.app), early[in_overlap.action_id], in_overlap,
                    settings=split.settings, seal_key=split.seal_key)
    for env, key_id in ((fresh, new_id), (in_overlap, old_id)):
        assert split.wait_settled(env.action_id).outcome == Outcome.completed_verified
        validated = next(e for e in split.timeline(env.action_id) if e["event"] == "validated")["evidence"]
        assert validated["key_id"] == key_id
    not_after = load_keyring(split.settings.keyring_file).get(old_id).not_after
    assert not_after > datetime.now(UTC) - timedelta(seconds=overlap)
    time.sleep(max(0.0, overlap + 0.5 - (time.monotonic() - rotated_at)))
    message = early[after_overlap.action_id]
    evidence = refusal(split, message, deliver(split, message))
    assert evidence["reason_code"] == "envelope_key_expired"
    assert split.effects(after_overlap.idempotency_key) == 0
