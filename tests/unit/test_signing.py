"""Envelope signatures (HMAC with key ids) and the worker's first validation stage."""

from __future__ import annotations

import copy
import hashlib
import hmac
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import pytest
import rfc8785

from proofline.contracts import contract_for
from proofline.envelope import Envelope, build_envelope
from proofline.errors import (
    ArgumentHashMismatch,
    BadSignature,
    ContractMismatch,
    IdempotencyKeyMismatch,
    MalformedEnvelope,
    UnknownActionType,
    UnknownSigningKey,
    UnsignedEnvelope,
)
from proofline.settings import ROOT, Settings
from proofline.signing import sign, verify
from worker.validate import MAX_MESSAGE_BYTES, validate_envelope

KEYS = {"k-2024": "old secret", "k-2025": "new secret"}
lookup = partial(contract_for, ROOT / "contracts")


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


def hmac_sign(document: dict[str, Any], key_id: str, keys: dict[str, str] = KEYS) -> dict[str, Any]:
    """Sign an arbitrary document as a controller holding the key would: HMAC-SHA256 over RFC 8785 JSON."""
    mac = hmac.new(keys[key_id].encode(), rfc8785.dumps(document), hashlib.sha256).hexdigest()
    return {"envelope": document, "key_id": key_id, "signature": mac}


def settings() -> Settings:
    return Settings(signing_keys=KEYS, active_key_id="k-2025")


# --- sign / verify ------------------------------------------------------------------------------


def test_roundtrip_returns_the_signed_document():
    env = envelope()
    message = sign(env, KEYS, "k-2025")
    assert message["key_id"] == "k-2025"
    document = verify(message, KEYS)
    assert Envelope.model_validate(document) == env


def test_signature_matches_an_independent_hmac():
    env = envelope()
    message = sign(env, KEYS, "k-2025")
    assert message == hmac_sign(env.model_dump(mode="json"), "k-2025")


def test_sign_with_unknown_key_id_refused():
    with pytest.raises(UnknownSigningKey):
        sign(envelope(), KEYS, "k-1999")


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
    ],
    ids=lambda p: ".".join(map(str, p)) if isinstance(p, tuple) else None,
)
def test_tampering_with_any_field_breaks_the_signature(path, value):
    message = sign(envelope(), KEYS, "k-2025")
    tampered = copy.deepcopy(message)
    _set(tampered["envelope"], path, value)
    assert tampered["envelope"] != message["envelope"]
    with pytest.raises(BadSignature):
        verify(tampered, KEYS)


def test_removing_a_field_breaks_the_signature():
    message = sign(envelope(), KEYS, "k-2025")
    del message["envelope"]["compensation_ref"]
    with pytest.raises(BadSignature):
        verify(message, KEYS)


def test_signature_from_another_key_breaks_it():
    message = sign(envelope(), KEYS, "k-2024")
    message["key_id"] = "k-2025"
    with pytest.raises(BadSignature):
        verify(message, KEYS)


@pytest.mark.parametrize("missing", ["signature", "key_id"])
def test_missing_signature_or_key_id_is_unsigned(missing):
    message = sign(envelope(), KEYS, "k-2025")
    del message[missing]
    with pytest.raises(UnsignedEnvelope):
        verify(message, KEYS)


def test_empty_signature_is_unsigned():
    message = sign(envelope(), KEYS, "k-2025")
    message["signature"] = ""
    with pytest.raises(UnsignedEnvelope):
        verify(message, KEYS)


def test_unknown_key_id_refused():
    message = sign(envelope(), KEYS, "k-2025")
    with pytest.raises(UnknownSigningKey):
        verify(message, {"k-2024": KEYS["k-2024"]})


def test_key_rotation():
    old = sign(envelope(), KEYS, "k-2024")
    new = sign(envelope(), KEYS, "k-2025")
    # While the old key is still in the set, messages signed with it verify.
    assert verify(old, KEYS) == old["envelope"]
    rotated = {"k-2025": KEYS["k-2025"]}
    assert verify(new, rotated) == new["envelope"]
    with pytest.raises(UnknownSigningKey):
        verify(old, rotated)


@pytest.mark.parametrize("message", [None, "text", 42, ["envelope"], {"envelope": "text"}, {"signature": "x"}])
def test_non_dict_messages_are_malformed(message):
    with pytest.raises(MalformedEnvelope):
        verify(message, KEYS)


def test_non_string_signature_is_malformed():
    message = sign(envelope(), KEYS, "k-2025")
    message["signature"] = 12345
    with pytest.raises(MalformedEnvelope):
        verify(message, KEYS)


@pytest.mark.parametrize(
    "bad",
    [float("nan"), float("inf"), 2**60, {1: "non-string key"}, object()],
    ids=["nan", "inf", "huge-int", "int-key", "object"],
)
def test_non_canonicalisable_content_is_malformed_not_a_crash(bad):
    message = sign(envelope(), KEYS, "k-2025")
    message["envelope"]["arguments"]["weird"] = bad
    with pytest.raises(MalformedEnvelope, match="canonicalisable"):
        verify(message, KEYS)


# --- worker validation --------------------------------------------------------------------------


def test_valid_message_passes_validation():
    env = envelope()
    validated, contract = validate_envelope(sign(env, KEYS, "k-2025"), settings(), lookup)
    assert validated == env
    assert contract.action_type == "ticket.create"
    assert contract.tool == env.tool.name


def test_tampered_message_refused_by_validation():
    message = sign(envelope(), KEYS, "k-2025")
    message["envelope"]["arguments"]["owner"] = "mallory"
    with pytest.raises(BadSignature):
        validate_envelope(message, settings(), lookup)


def test_argument_hash_mismatch_refused_even_when_signed():
    doc = envelope().model_dump(mode="json")
    doc["arguments"]["title"] = "Something else"
    # Signed through sign() itself: a key holder who edits the arguments but not the hash.
    message = sign(Envelope.model_validate(doc), KEYS, "k-2025")
    assert verify(message, KEYS) == doc
    with pytest.raises(ArgumentHashMismatch) as info:
        validate_envelope(message, settings(), lookup)
    assert info.value.code == "envelope_argument_hash_mismatch"


def test_idempotency_key_mismatch_refused_even_when_signed():
    doc = envelope().model_dump(mode="json")
    doc["idempotency_key"] = "pl1-" + "0" * 48
    message = hmac_sign(doc, "k-2024")
    with pytest.raises(IdempotencyKeyMismatch) as info:
        validate_envelope(message, settings(), lookup)
    assert info.value.code == "envelope_idempotency_key_mismatch"


def test_changed_intent_with_stale_key_refused():
    """A key holder re-targets the action and fixes the hash but reuses the old key."""
    original = envelope()
    retargeted = envelope(target={"type": "ticket_queue", "id": "billing"})
    doc = retargeted.model_dump(mode="json")
    doc["idempotency_key"] = original.idempotency_key
    with pytest.raises(IdempotencyKeyMismatch):
        validate_envelope(hmac_sign(doc, "k-2025"), settings(), lookup)


def test_contract_mismatch_refused():
    env = envelope(tool={"name": "close_ticket", "contract_hash": "b" * 64})
    with pytest.raises(ContractMismatch) as info:
        validate_envelope(sign(env, KEYS, "k-2025"), settings(), lookup)
    assert info.value.code == "contract_mismatch"
    assert info.value.context["mismatches"] == {"tool": ("close_ticket", "create_ticket")}


def test_operation_and_target_type_mismatch_refused():
    env = envelope(operation="close", target={"type": "ticket", "id": "T-1"})
    with pytest.raises(ContractMismatch) as info:
        validate_envelope(sign(env, KEYS, "k-2025"), settings(), lookup)
    assert set(info.value.context["mismatches"]) == {"operation", "target_type"}


def test_unknown_action_type_refused():
    env = envelope(action_type="ticket.delete")
    with pytest.raises(UnknownActionType):
        validate_envelope(sign(env, KEYS, "k-2025"), settings(), lookup)


def test_schema_invalid_but_signed_is_malformed():
    doc = envelope().model_dump(mode="json")
    doc["schema_version"] = 2
    with pytest.raises(MalformedEnvelope, match="schema"):
        validate_envelope(hmac_sign(doc, "k-2025"), settings(), lookup)


def test_oversized_message_refused():
    env = envelope(arguments={"tenant": "acme", "title": "x", "owner": "ops", "body": "y" * MAX_MESSAGE_BYTES})
    message = sign(env, KEYS, "k-2025")
    assert verify(message, KEYS)  # correctly signed: the size alone refuses it
    with pytest.raises(MalformedEnvelope, match="limit"):
        validate_envelope(message, settings(), lookup)


def test_message_just_under_the_limit_is_accepted():
    env = envelope(arguments={"tenant": "acme", "title": "x", "owner": "ops", "body": "y" * (MAX_MESSAGE_BYTES // 2)})
    validated, _ = validate_envelope(sign(env, KEYS, "k-2025"), settings(), lookup)
    assert validated.arguments["body"] == env.arguments["body"]
