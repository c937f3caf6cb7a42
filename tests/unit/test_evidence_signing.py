"""Worker keys: they sign evidence statements and nothing else, and an evidence statement verifies
only with an active worker key (proofline/signing.py), in the digest form the ledger compares
(ledger/evidence.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

import pytest

from ledger import evidence
from ledger.states import ActionStatus, Outcome
from ledger.store import ActionRow
from proofline.contracts import contract_for
from proofline.errors import EvidenceUnsigned, WrongKeyRole
from proofline.keys import KeyRole, SigningKey, load_signing_key
from proofline.settings import ROOT, Settings
from proofline.signing import check_role, sign, sign_document, sign_evidence, verify, verify_evidence
from tests.unit import test_signing
from tests.unit.test_signing import derived, envelope, with_entry
from worker.validate import validate_envelope

lookup = partial(contract_for, ROOT / "contracts")
#: The development keys and keyring the envelope tests use (module-scoped fixtures).
keys_dir, ring = test_signing.keys_dir, test_signing.ring


@pytest.fixture(scope="module")
def worker(keys_dir: Path) -> SigningKey:
    return load_signing_key(keys_dir / "worker.key", KeyRole.worker)


def claims(**changes: object) -> dict[str, object]:
    base = evidence.statement(action_id="act-1", idempotency_key="k-1", status=ActionStatus.recovery,
                              outcome=Outcome.failed_after_side_effect, finding="prohibited",
                              reason_code="verification_failed", result={"values": {"id": "T-1"}},
                              recovery_data={"before": {"n": 1}, "after": {"id": "T-1", "status": "open"}},
                              signer="host:1")
    return {**base, **changes}


# --- a worker key on envelopes ------------------------------------------------------------------


@pytest.mark.parametrize("make", [envelope, derived], ids=["fresh", "derived"])
def test_a_worker_key_signs_no_envelope(make, worker, ring, keys_dir):
    env = make()
    with pytest.raises(WrongKeyRole) as signing:
        sign(env, worker)
    assert signing.value.code == "envelope_wrong_key_role"
    with pytest.raises(WrongKeyRole):
        check_role(env, KeyRole.worker)
    # Signed anyway (by hand): every verifier refuses it with the same reason code.
    message = sign_document(env.model_dump(mode="json"), worker)
    with pytest.raises(WrongKeyRole) as verifying:
        verify(message, ring)
    assert verifying.value.code == "envelope_wrong_key_role"
    with pytest.raises(WrongKeyRole):
        validate_envelope(message, Settings(keys_dir=keys_dir), lookup)


def test_only_a_worker_key_signs_evidence(keys_dir):
    for role in (KeyRole.controller, KeyRole.recovery, KeyRole.ledger):
        with pytest.raises(WrongKeyRole):
            sign_evidence(claims(), load_signing_key(keys_dir / f"{role.value}.key", role))


# --- verifying evidence -------------------------------------------------------------------------


def test_evidence_roundtrip(worker, ring):
    assert verify_evidence(sign_evidence(claims(), worker), ring, None).key_id == worker.key_id


@pytest.mark.parametrize(("seal", "cause"), [
    (None, "missing"), ({"statement": "x"}, "missing"), ({"statement": {}, "key_id": 1, "signature": "a"}, "malformed"),
], ids=["none", "not-a-statement", "non-string"])
def test_malformed_evidence_is_unsigned(seal, cause, ring):
    with pytest.raises(EvidenceUnsigned) as info:
        verify_evidence(seal, ring, None)
    assert (info.value.code, info.value.context["cause"]) == ("evidence_unsigned", cause)


def test_a_changed_statement_breaks_the_signature(worker, ring):
    seal = sign_evidence(claims(), worker)
    seal["statement"] = {**seal["statement"], "finding": "expected"}
    with pytest.raises(EvidenceUnsigned) as info:
        verify_evidence(seal, ring, None)
    assert info.value.context["cause"] == "bad_signature"


def test_evidence_signed_by_a_non_worker_key_is_refused(keys_dir, worker, ring):
    recovery = load_signing_key(keys_dir / "recovery.key", KeyRole.recovery)
    # The recovery key's bytes over the same statement, presented as evidence.
    forged = {**sign_evidence(claims(), worker), "key_id": recovery.key_id}
    forged["signature"] = sign_evidence(claims(), SigningKey(recovery.key_id, KeyRole.worker,
                                                             recovery.private))["signature"]
    with pytest.raises(EvidenceUnsigned) as info:
        verify_evidence(forged, ring, None)
    assert info.value.context["cause"] == "wrong_key_role"


def test_revoked_unknown_and_retired_worker_keys(worker, ring):
    seal = sign_evidence(claims(), worker)
    with pytest.raises(EvidenceUnsigned) as revoked:
        verify_evidence(seal, with_entry(ring, worker, revoked=True), None)
    assert revoked.value.context["cause"] == "revoked_key"
    with pytest.raises(EvidenceUnsigned) as unknown:
        verify_evidence({**seal, "key_id": "worker-gone"}, ring, None)
    assert unknown.value.context["cause"] == "unknown_key"
    now = datetime.now(UTC)
    retired = with_entry(ring, worker, not_after=now - timedelta(minutes=1))
    # Stored before the key retired: still its evidence. Stored after (or never): refused.
    assert verify_evidence(seal, retired, now - timedelta(minutes=2)).key_id == worker.key_id
    for stored in (now, None):
        with pytest.raises(EvidenceUnsigned) as expired:
            verify_evidence(seal, retired, stored)
        assert expired.value.context["cause"] == "expired_key"


# --- comparing a row with its statement -----------------------------------------------------------


def row(**changes: object) -> ActionRow:
    now = datetime.now(UTC)
    fields: dict[str, object] = dict(
        action_id="act-1", run_id="run-1", step=0, tenant="acme", action_type="ticket.create", tool="create_ticket",
        idempotency_key="k-1", status=ActionStatus.recovery, outcome=Outcome.failed_after_side_effect,
        finding="prohibited", reason_code="verification_failed", envelope={}, result={"values": {"id": "T-1"}},
        recovery_data={"before": {"n": 1.0}, "after": {"id": "T-1", "status": "open"}, "redrives": 2},
        deadline=now, published_at=now, updated_at=now)
    fields.update(changes)
    return ActionRow(**fields)  # type: ignore[arg-type]


def test_a_row_equal_to_its_statement_has_no_mismatch():
    # Bookkeeping outside the snapshots (redrives) and jsonb's number spelling (1.0 for 1) do not count.
    assert evidence.mismatches(row(), claims(), (ActionStatus.recovery,)) == {}


@pytest.mark.parametrize(("changes", "columns"), [
    ({"finding": "expected"}, {"finding"}),
    ({"outcome": Outcome.completed_verified}, {"outcome"}),
    ({"result": {"values": {"id": "T-2"}}}, {"result"}),
    ({"recovery_data": {"before": {"n": 1}, "after": {"id": "T-9", "status": "open"}}}, {"recovery_data"}),
    ({"status": ActionStatus.closed}, set()),
    ({"action_id": "act-2"}, {"action_id"}),
], ids=["finding", "outcome", "result", "after", "status-not-compared-with-row", "other-action"])
def test_each_forged_column_is_named(changes, columns):
    assert set(evidence.mismatches(row(**changes), claims(), (ActionStatus.recovery,))) == columns


def test_a_statement_of_another_status_does_not_vouch():
    found = evidence.mismatches(row(), claims(status="closed"), (ActionStatus.recovery,))
    assert found == {"status": ["recovery", "closed"]}


@pytest.mark.parametrize("value", [10**400, "\ud800", 1e20, [1, 2.5, {"a": None}]],
                         ids=["huge-int", "lone-surrogate", "big-float", "mixed"])
def test_any_stored_value_has_one_stable_digest(value):
    """A hostile tool result may hold what RFC 8785 refuses: signing must not fail on it, and the
    digest of the value and of its jsonb spelling agree."""
    first = evidence.digest({"values": value})
    assert first is not None and first.startswith("sha256:")
    assert evidence.digest({"values": value}) == first
    assert evidence.digest({"values": value}) != evidence.digest({"values": "other"})


def test_jsonb_spelling_of_numbers_does_not_count():
    assert evidence.digest({"n": 1e20}) == evidence.digest({"n": 10**20})
    assert evidence.digest({"n": 1}) == evidence.digest({"n": 1.0})
    assert evidence.digest({"n": 1}) != evidence.digest({"n": 2})
