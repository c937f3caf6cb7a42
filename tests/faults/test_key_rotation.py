"""Controller key rotation with signed messages already stored in the ledger.

The rule (docs/concepts/authority.md, Keys and signatures): a key past its ``not_after`` is *retired*: it signs nothing
new, but a message the ledger stored before it retired is still the authority it was, so a re-drive
of it (the broker lost the message) runs. A *revoked* key is refused whatever was stored, with
``envelope_key_revoked``, and the action it signed never runs: it ends
``deadline_expired_unexecuted`` with that refusal as its evidence.

The messages are "lost" by publishing through a broker that drops them (the ledger records them);
the keys are rotated with no overlap, so the old key has retired before any worker starts; the
reconciler then re-drives the stored messages to real workers. A second test runs a whole
multi-step run, with a compensation, on messages signed by a key that retired before it started.
"""

from __future__ import annotations

from datetime import timedelta

from ledger.states import ActionStatus, Outcome
from proofline.controller import publish_message, signed_message
from proofline.errors import ExpiredSigningKey
from proofline.keys import KeyRole, load_keyring, read_signing_key, revoke, rotate
from proofline.signing import sign
from proofline_kit.sor import store as sor
from tests.conftest import Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import (
    LosingBroker,
    new_account,
    recovery_action,
    refund_env,
    run_of,
    run_settled,
    stale_close_env,
    ticket_env,
)


def lose(stack: Stack, envelope) -> dict:
    """Publish: recorded in the ledger, signed with the current controller key, never queued."""
    broker = LosingBroker()
    publish_message(stack.conn, broker, signed_message(stack.settings, envelope), envelope, settings=stack.settings)
    assert len(broker.lost) == 1
    return broker.lost[0]


def refusals_for(stack: Stack, action_id: str) -> list[dict]:
    return [r["evidence"] for r in stack.refusals() if r["evidence"].get("claimed", {}).get("action_id") == action_id]


def test_stored_message_runs_after_its_key_retired_and_a_revoked_one_never_does(tmp_path) -> None:
    s = build_stack("stdio", tmp_path, extra_env={"PROOFLINE_DEADLINE_GRACE_SECONDS": "1"})
    try:
        keys_dir = s.settings.keys_dir
        key_file = s.settings.signing_key_file
        # B is stored under K1; K1 is rotated out and then revoked.
        # Its deadline must outlast the workers' start below (it is signed now, they start later: on a
        # loaded machine a start took more than the 12 s this once was, and the first sweep found it
        # expired before any re-send could be refused), and it bounds how long the test waits for it.
        revoked_env = ticket_env(s, deadline_in=timedelta(seconds=45), timeout_seconds=2)
        k1 = lose(s, revoked_env)["key_id"]
        old, _ = rotate(keys_dir, KeyRole.controller, overlap=timedelta(0))
        assert old == k1
        revoke(s.settings.keyring_file, k1)
        # A is stored under K2; K2 is rotated out (retired) but not revoked.
        retired_env = ticket_env(s)
        k2_signer = read_signing_key(key_file, KeyRole.controller)
        stored = lose(s, retired_env)
        assert stored["key_id"] == k2_signer.key_id != k1
        rotate(keys_dir, KeyRole.controller, overlap=timedelta(0))
        ring = load_keyring(s.settings.keyring_file)
        assert ring.get(k1).revoked and not ring.get(k2_signer.key_id).revoked
        assert ring.get(k2_signer.key_id).not_after is not None

        # The retired key mints nothing new: publication refuses it, and so does a worker.
        fresh = ticket_env(s)
        try:
            publish_message(s.conn, LosingBroker(), sign(fresh, k2_signer), fresh, settings=s.settings)
        except ExpiredSigningKey:
            pass
        else:
            raise AssertionError("a new message signed with a retired key was published")
        assert s.action(fresh.action_id) is None

        start_workers(s)
        s.deliver(sign(fresh, k2_signer))
        row = s.wait_settled(retired_env.action_id, timeout=60)
        assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
        assert s.witness.count(key=retired_env.idempotency_key) == 1
        assert s.effects(retired_env.idempotency_key) == 1
        timeline = s.timeline(retired_env.action_id)
        assert "redriven" in [e["event"] for e in timeline]
        validated = [e["evidence"] for e in timeline if e["event"] == "validated"]
        assert validated[0]["key_id"] == k2_signer.key_id
        assert validated[0]["key_retired_after_storage"]["key_id"] == k2_signer.key_id

        fresh_refusals = wait_for(lambda: refusals_for(s, fresh.action_id), 30, what="the retired key's new message")
        assert {r["reason_code"] for r in fresh_refusals} == {ExpiredSigningKey.code}
        assert s.witness.count(key=fresh.idempotency_key) == 0
        assert s.effects(fresh.idempotency_key) == 0

        revoked_refusals = wait_for(lambda: refusals_for(s, revoked_env.action_id), 30,
                                    what="the revoked key's stored message to be refused")
        assert {r["reason_code"] for r in revoked_refusals} == {"envelope_key_revoked"}
        closed = s.wait_settled(revoked_env.action_id, timeout=120)
        assert (closed.status, closed.outcome, closed.reason_code) == (
            ActionStatus.closed, Outcome.not_started, "deadline_expired_unexecuted")
        expiry = [e["evidence"] for e in s.timeline(revoked_env.action_id)
                  if e["event"] == "deadline_expired_unexecuted"]
        assert expiry and expiry[0]["last_refusal"]["reason_code"] == "envelope_key_revoked"
        assert "tool_called" not in s.events(revoked_env.action_id)
        assert s.witness.count(key=revoked_env.idempotency_key) == 0
        assert s.effects(revoked_env.idempotency_key) == 0
    finally:
        teardown_stack(s)


def test_a_run_outlives_the_rotation_of_the_key_that_signed_it(tmp_path) -> None:
    """Every step of a run is signed and stored when the run is published; the later steps are sent
    when the earlier ones are verified, and compensations derive from the stored parents. With the
    controller key rotated out (no overlap) right after publication, step 1 is still released and
    run, and when step 2 fails, the refund of step 1 is compensated from its stored message."""
    s = build_stack("stdio", tmp_path)
    try:
        account = new_account(s)
        steps = run_of(s, [lambda **kw: refund_env(s, account, **kw), lambda **kw: ticket_env(s, **kw),
                           lambda **kw: stale_close_env(s, **kw)])
        broker = LosingBroker()  # nothing runs before the rotation: step 0 waits for a re-drive
        for env in steps:
            publish_message(s.conn, broker, s.message(env), env, settings=s.settings, hold=env.step > 0)
        old, new = rotate(s.settings.keys_dir, KeyRole.controller, overlap=timedelta(0))
        assert {m["key_id"] for m in broker.lost} == {old} != {new}
        start_workers(s)
        run_settled(s, steps[0].run_id, expect="compensated")
        rows = [s.action(e.action_id) for e in steps]
        assert [r.outcome for r in rows] == [Outcome.compensated, Outcome.compensated, Outcome.not_started]
        retired = [e["evidence"].get("key_retired_after_storage", {}).get("key_id")
                   for env in steps[:2] for e in s.timeline(env.action_id) if e["event"] == "validated"]
        assert retired and set(retired) == {old}
        refund_comp = s.action(recovery_action(s, steps[0].action_id))
        assert refund_comp.outcome == Outcome.completed_verified
        assert sor.find_refund_by_key(s.sor_db, steps[0].idempotency_key)["refund"]["status"] == "reversed"
        for env in steps[:2]:
            assert s.witness.count(key=env.idempotency_key) == 1
            assert s.effects(env.idempotency_key) == 1
        assert s.witness.count(key=refund_comp.idempotency_key) == 1
        assert s.effects(refund_comp.idempotency_key) == 1
        assert s.witness.count(key=steps[2].idempotency_key) == 0
    finally:
        teardown_stack(s)
