"""Envelope signatures (Ed25519 with key ids and roles) and the worker's first validation stage."""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from proofline.contracts import contract_for
from proofline.envelope import Envelope, build_envelope
from proofline.errors import (
    ArgumentHashMismatch,
    BadSignature,
    ContractMismatch,
    ExpiredSigningKey,
    IdempotencyKeyMismatch,
    MalformedEnvelope,
    RevokedSigningKey,
    UnknownActionType,
    UnknownSigningKey,
    UnsignedEnvelope,
    WrongKeyRole,
)
from proofline.keys import Keyring, KeyRole, PublicKey, SigningKey, generate, load_keyring, load_signing_key
from proofline.settings import ROOT, Settings
from proofline.signing import message_hash, sign, sign_document, verify
from worker.validate import MAX_MESSAGE_BYTES, validate_envelope

lookup = partial(contract_for, ROOT / "contracts")


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("keys")
    generate(directory, development=True)
    return directory


@pytest.fixture(scope="module")
def controller(keys_dir: Path) -> SigningKey:
    return load_signing_key(keys_dir / "controller.key", KeyRole.controller)


@pytest.fixture(scope="module")
def recovery(keys_dir: Path) -> SigningKey:
    return load_signing_key(keys_dir / "recovery.key", KeyRole.recovery)


@pytest.fixture(scope="module")
def ring(keys_dir: Path) -> Keyring:
    return load_keyring(keys_dir / "keyring.json")


@pytest.fixture()
def settings(keys_dir: Path) -> Settings:
    return Settings(keys_dir=keys_dir)


def envelope(**overrides: Any) -> Envelope:
    now = datetime.now(UTC)
    fields: dict[str, Any] = {
        "run_id": "run-1", "action_id": "act-1", "workflow_type": "agent.ops", "action_type": "ticket.create",
        "requester": "operator@example.com", "workload_identity": "agent:ops-assistant", "tenant": "acme",
        "environment": "production", "target": {"type": "ticket_queue", "id": "support"},
        "operation": "create",
        "arguments": {"tenant": "acme", "title": "Disk full", "owner": "ops", "tags": ["disk", "p2"]},
        "server": {"name": "sor", "version": "1.0.0"},
        "tool": {"name": "create_ticket", "contract_hash": "b" * 64},
        "policy_version": 5,
        "approval": {"id": "apr-1", "version": 1, "expires_at": now + timedelta(hours=1)},
        "timeout_seconds": 5, "deadline": now + timedelta(minutes=10),
    }
    fields.update(overrides)
    return build_envelope(**fields)


def derived(**overrides: Any) -> Envelope:
    """A compensation-shaped envelope (ticket.close recovering act-1)."""
    fields: dict[str, Any] = {"action_id": "act-1.compensation", "action_type": "ticket.close", "operation": "close",
                              "target": {"type": "ticket", "id": "T-1", "expected_version": 1},
                              "arguments": {"ticket_id": "T-1", "expected_version": 1},
                              "tool": {"name": "close_ticket", "contract_hash": "b" * 64},
                              "recovers": "act-1", "parent_message_hash": "c" * 64}
    fields.update(overrides)
    return envelope(**fields)


def with_entry(ring: Keyring, key: SigningKey, **changes: Any) -> Keyring:
    """The keyring with ``key``'s entry changed (revoked, not_after, role)."""
    entry = ring.get(key.key_id)
    assert entry is not None
    fields = {"key_id": entry.key_id, "role": entry.role, "public": entry.public, "not_after": entry.not_after,
              "revoked": entry.revoked, "development": entry.development, **changes}
    return Keyring({**ring.keys, key.key_id: PublicKey(**fields)})


# --- sign / verify ------------------------------------------------------------------------------


def test_roundtrip_returns_the_signed_document(controller, ring):
    env = envelope()
    message = sign(env, controller)
    assert message["key_id"] == controller.key_id
    verified = verify(message, ring)
    assert Envelope.model_validate(verified.document) == env
    assert verified.key.role == KeyRole.controller


def test_signature_is_ed25519_over_rfc8785_json(controller, keys_dir):
    """Checked with the public key alone, independently of proofline.signing."""
    import json

    env = envelope()
    message = sign(env, controller)
    entry = next(e for e in json.loads((keys_dir / "keyring.json").read_text())["keys"]
                 if e["key_id"] == controller.key_id)
    public = Ed25519PublicKey.from_public_bytes(base64.b64decode(entry["public_key"]))
    public.verify(base64.b64decode(message["signature"]), rfc8785.dumps(env.model_dump(mode="json")))


def _set(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    for part in path[:-1]:
        doc = doc[part]
    doc[path[-1]] = value


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("tenant",), "globex"),
        (("arguments", "title"), "Disk empty"),
        (("arguments", "tags", 0), "p1"),
        (("target", "id"), "billing"),
        (("approval", "version"), 2),
        (("approval", "covers_irreversible"), True),
        (("tool", "contract_hash"), "c" * 64),
        (("authority_budget", "max_calls"), 20),
        (("evidence", "redact_fields", 0), "nothing"),
        (("irreversible",), True),
        (("arguments", "extra"), "added"),
        (("recovers",), "act-0"),
    ],
    ids=lambda p: ".".join(map(str, p)) if isinstance(p, tuple) else None,
)
def test_tampering_with_any_field_breaks_the_signature(path, value, controller, ring):
    message = sign(envelope(), controller)
    tampered = copy.deepcopy(message)
    _set(tampered["envelope"], path, value)
    assert tampered["envelope"] != message["envelope"]
    with pytest.raises(BadSignature):
        verify(tampered, ring)


def test_removing_a_field_breaks_the_signature(controller, ring):
    message = sign(envelope(), controller)
    del message["envelope"]["compensation_ref"]
    with pytest.raises(BadSignature):
        verify(message, ring)


def test_signature_from_another_key_breaks_it(controller, recovery, ring):
    message = sign_document(envelope().model_dump(mode="json"), recovery)
    message["key_id"] = controller.key_id
    with pytest.raises(BadSignature):
        verify(message, ring)


@pytest.mark.parametrize("spelling", ["upper", "urlsafe", "unpadded", "short", "hex", "non_ascii"])
def test_only_the_canonical_base64_spelling_verifies(spelling, controller, ring):
    message = sign(envelope(), controller)
    raw = base64.b64decode(message["signature"])
    message["signature"] = {
        "upper": message["signature"].upper(), "urlsafe": base64.urlsafe_b64encode(raw).decode() + "_",
        "unpadded": message["signature"].rstrip("="), "short": base64.b64encode(raw[:32]).decode(),
        "hex": raw.hex(), "non_ascii": "\u00e9" + message["signature"][1:],
    }[spelling]
    with pytest.raises(BadSignature):
        verify(message, ring)


@pytest.mark.parametrize("missing", ["signature", "key_id"])
def test_missing_signature_or_key_id_is_unsigned(missing, controller, ring):
    message = sign(envelope(), controller)
    del message[missing]
    with pytest.raises(UnsignedEnvelope):
        verify(message, ring)


def test_empty_signature_is_unsigned(controller, ring):
    message = sign(envelope(), controller)
    message["signature"] = ""
    with pytest.raises(UnsignedEnvelope):
        verify(message, ring)


def test_unknown_key_id_refused(controller, ring):
    message = sign(envelope(), controller)
    with pytest.raises(UnknownSigningKey):
        verify(message, Keyring({k: v for k, v in ring.keys.items() if k != controller.key_id}))


def test_hmac_with_the_old_development_key_is_refused(controller, ring):
    doc = envelope().model_dump(mode="json")
    mac = hmac.new(b"proofline-development-key", rfc8785.dumps(doc), hashlib.sha256).hexdigest()
    with pytest.raises(UnknownSigningKey):
        verify({"envelope": doc, "key_id": "dev-1", "signature": mac}, ring)
    with pytest.raises(BadSignature):
        verify({"envelope": doc, "key_id": controller.key_id, "signature": mac}, ring)


def test_public_key_material_cannot_sign(controller, ring):
    """Whatever a worker holds (the public key bytes) used as a seed or an HMAC secret: refused."""
    public = ring.get(controller.key_id).public
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    raw = public.public_bytes(Encoding.Raw, PublicFormat.Raw)
    doc = envelope().model_dump(mode="json")
    forged = SigningKey(controller.key_id, KeyRole.controller, Ed25519PrivateKey.from_private_bytes(raw))
    with pytest.raises(BadSignature):
        verify(sign_document(doc, forged), ring)
    mac = base64.b64encode(hmac.new(raw, rfc8785.dumps(doc), hashlib.sha512).digest()).decode()
    with pytest.raises(BadSignature):
        verify({"envelope": doc, "key_id": controller.key_id, "signature": mac}, ring)


def test_revoked_key_refused_with_its_own_code(controller, ring):
    message = sign(envelope(), controller)
    with pytest.raises(RevokedSigningKey) as info:
        verify(message, with_entry(ring, controller, revoked=True))
    assert info.value.code == "envelope_key_revoked"


def test_expired_key_refused_until_not_after_then_refused(controller, ring):
    message = sign(envelope(), controller)
    now = datetime.now(UTC)
    overlap = with_entry(ring, controller, not_after=now + timedelta(minutes=5))
    assert verify(message, overlap, now=now).document == message["envelope"]
    with pytest.raises(ExpiredSigningKey) as info:
        verify(message, overlap, now=now + timedelta(minutes=5))
    assert info.value.code == "envelope_key_expired"


def test_ledger_key_may_not_sign_envelopes(keys_dir, ring):
    ledger = load_signing_key(keys_dir / "ledger.key", KeyRole.ledger)
    with pytest.raises(WrongKeyRole):
        verify(sign_document(envelope().model_dump(mode="json"), ledger), ring)


def test_key_rotation_with_overlap(controller, ring):
    """Two controller keys verify at once; the old one only until its not_after."""
    new = SigningKey("controller-new", KeyRole.controller, Ed25519PrivateKey.generate())
    now = datetime.now(UTC)
    rotated = with_entry(ring, controller, not_after=now + timedelta(hours=1))
    rotated = Keyring({**rotated.keys, new.key_id: PublicKey(new.key_id, KeyRole.controller,
                                                              new.private.public_key())})
    old_message, new_message = sign(envelope(), controller), sign(envelope(), new)
    assert verify(old_message, rotated, now=now).key.key_id == controller.key_id
    assert verify(new_message, rotated, now=now).key.key_id == "controller-new"
    later = now + timedelta(hours=2)
    assert verify(new_message, rotated, now=later).key.key_id == "controller-new"
    with pytest.raises(ExpiredSigningKey):
        verify(old_message, rotated, now=later)


@pytest.mark.parametrize("message", [None, "text", 42, ["envelope"], {"envelope": "text"}, {"signature": "x"}])
def test_non_dict_messages_are_malformed(message, ring):
    with pytest.raises(MalformedEnvelope):
        verify(message, ring)


def test_non_string_signature_is_malformed(controller, ring):
    message = sign(envelope(), controller)
    message["signature"] = 12345
    with pytest.raises(MalformedEnvelope):
        verify(message, ring)


@pytest.mark.parametrize(
    "bad",
    [float("nan"), float("inf"), 2**60, {1: "non-string key"}, object()],
    ids=["nan", "inf", "huge-int", "int-key", "object"],
)
def test_non_canonicalisable_content_is_malformed_not_a_crash(bad, controller, ring):
    message = sign(envelope(), controller)
    message["envelope"]["arguments"]["weird"] = bad
    with pytest.raises(MalformedEnvelope, match="canonicalisable"):
        verify(message, ring)


# --- key roles ----------------------------------------------------------------------------------


def test_signer_refuses_the_wrong_role(controller, recovery):
    with pytest.raises(WrongKeyRole):
        sign(envelope(), recovery)  # a fresh action
    with pytest.raises(WrongKeyRole):
        sign(derived(), controller)  # a derived recovery envelope


def test_parent_link_only_on_recovery_envelopes():
    with pytest.raises(ValueError, match="parent_message_hash"):
        envelope(parent_message_hash="c" * 64)
    with pytest.raises(ValueError, match="parent_message_hash"):
        derived(parent_message_hash=None)


def test_message_hash_covers_envelope_key_and_signature(controller):
    message = sign(envelope(), controller)
    assert message_hash(message) == hashlib.sha256(rfc8785.dumps(message)).hexdigest()
    assert message_hash({**message, "key_id": "other"}) != message_hash(message)


def test_validation_refuses_a_recovery_key_on_a_fresh_action(recovery, settings):
    message = sign_document(envelope().model_dump(mode="json"), recovery)
    with pytest.raises(WrongKeyRole) as info:
        validate_envelope(message, settings, lookup)
    assert info.value.code == "envelope_wrong_key_role"


def test_validation_refuses_a_controller_key_on_a_derived_envelope(controller, settings):
    message = sign_document(derived().model_dump(mode="json"), controller)
    with pytest.raises(WrongKeyRole):
        validate_envelope(message, settings, lookup)


def test_validation_accepts_a_recovery_signed_derived_envelope(recovery, settings):
    env = derived()
    validated, contract = validate_envelope(sign(env, recovery), settings, lookup)
    assert validated == env and contract.action_type == "ticket.close"


# --- worker validation --------------------------------------------------------------------------


def test_valid_message_passes_validation(controller, settings):
    env = envelope()
    validated, contract = validate_envelope(sign(env, controller), settings, lookup)
    assert validated == env
    assert contract.action_type == "ticket.create"
    assert contract.tool == env.tool.name


def test_tampered_message_refused_by_validation(controller, settings):
    message = sign(envelope(), controller)
    message["envelope"]["arguments"]["owner"] = "mallory"
    with pytest.raises(BadSignature):
        validate_envelope(message, settings, lookup)


def test_argument_hash_mismatch_refused_even_when_signed(controller, ring, settings):
    doc = envelope().model_dump(mode="json")
    doc["arguments"]["title"] = "Something else"
    # Signed through sign() itself: a key holder who edits the arguments but not the hash.
    message = sign(Envelope.model_validate(doc), controller)
    assert verify(message, ring).document == doc
    with pytest.raises(ArgumentHashMismatch) as info:
        validate_envelope(message, settings, lookup)
    assert info.value.code == "envelope_argument_hash_mismatch"


def test_idempotency_key_mismatch_refused_even_when_signed(controller, settings):
    doc = envelope().model_dump(mode="json")
    doc["idempotency_key"] = "pl1-" + "0" * 48
    with pytest.raises(IdempotencyKeyMismatch) as info:
        validate_envelope(sign_document(doc, controller), settings, lookup)
    assert info.value.code == "envelope_idempotency_key_mismatch"


def test_changed_intent_with_stale_key_refused(controller, settings):
    """A key holder re-targets the action and fixes the hash but reuses the old key."""
    original = envelope()
    retargeted = envelope(target={"type": "ticket_queue", "id": "billing"})
    doc = retargeted.model_dump(mode="json")
    doc["idempotency_key"] = original.idempotency_key
    with pytest.raises(IdempotencyKeyMismatch):
        validate_envelope(sign_document(doc, controller), settings, lookup)


def test_contract_mismatch_refused(controller, settings):
    env = envelope(tool={"name": "close_ticket", "contract_hash": "b" * 64})
    with pytest.raises(ContractMismatch) as info:
        validate_envelope(sign(env, controller), settings, lookup)
    assert info.value.code == "contract_mismatch"
    assert info.value.context["mismatches"] == {"tool": ("close_ticket", "create_ticket")}


def test_operation_and_target_type_mismatch_refused(controller, settings):
    env = envelope(operation="close", target={"type": "ticket", "id": "T-1"})
    with pytest.raises(ContractMismatch) as info:
        validate_envelope(sign(env, controller), settings, lookup)
    assert set(info.value.context["mismatches"]) == {"operation", "target_type"}


def test_unknown_action_type_refused(controller, settings):
    env = envelope(action_type="ticket.delete")
    with pytest.raises(UnknownActionType):
        validate_envelope(sign(env, controller), settings, lookup)


def test_schema_invalid_but_signed_is_malformed(controller, settings):
    doc = envelope().model_dump(mode="json")
    doc["schema_version"] = 2
    with pytest.raises(MalformedEnvelope, match="schema"):
        validate_envelope(sign_document(doc, controller), settings, lookup)


def test_oversized_message_refused(controller, ring, settings):
    env = envelope(arguments={"tenant": "acme", "title": "x", "owner": "ops", "body": "y" * MAX_MESSAGE_BYTES})
    message = sign(env, controller)
    assert verify(message, ring)  # correctly signed: the size alone refuses it
    with pytest.raises(MalformedEnvelope, match="limit"):
        validate_envelope(message, settings, lookup)


def test_message_just_under_the_limit_is_accepted(controller, settings):
    env = envelope(arguments={"tenant": "acme", "title": "x", "owner": "ops", "body": "y" * (MAX_MESSAGE_BYTES // 2)})
    validated, _ = validate_envelope(sign(env, controller), settings, lookup)
    assert validated.arguments["body"] == env.arguments["body"]
