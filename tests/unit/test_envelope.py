"""The envelope: hashes and idempotency key computed in trusted code, immutable, strict, and the
published JSON Schema kept equal to the model."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from proofline.canonical import sha256_hex
from proofline.envelope import Envelope, build_envelope, key_for
from proofline.settings import ROOT


def fields(**overrides: Any) -> dict[str, Any]:
    """Every field build_envelope needs, for a ticket.create intent."""
    base: dict[str, Any] = {
        "run_id": "run-1",
        "action_id": "act-1",
        "workflow_type": "agent.ops",
        "action_type": "ticket.create",
        "requester": "operator@example.com",
        "workload_identity": "agent:ops-assistant",
        "tenant": "acme",
        "environment": "production",
        "target": {"type": "ticket_queue", "id": "support"},
        "operation": "create",
        "arguments": {"tenant": "acme", "title": "Disk full", "owner": "ops", "tags": ["disk", "p2"]},
        "server": {"name": "sor", "version": "1.0.0"},
        "tool": {"name": "create_ticket", "contract_hash": "a" * 64},
        "policy_version": 5,
        "approval": {"id": "apr-1", "version": 1, "expires_at": datetime(2030, 1, 1, tzinfo=UTC)},
        "timeout_seconds": 5,
        "deadline": datetime(2030, 1, 1, 0, 10, tzinfo=UTC),
    }
    base.update(overrides)
    return base


def test_build_computes_argument_hash_and_key():
    env = build_envelope(**fields())
    assert env.arguments_hash == sha256_hex(fields()["arguments"])
    assert env.idempotency_key.startswith("pl1-")
    assert env.idempotency_key == key_for(env)


def test_argument_hash_ignores_key_order():
    args = fields()["arguments"]
    reordered = dict(reversed(list(args.items())))
    assert list(reordered) != list(args)
    assert build_envelope(**fields(arguments=reordered)).idempotency_key == build_envelope(**fields()).idempotency_key


moments = st.datetimes(min_value=datetime(2026, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC))


@settings(max_examples=200, deadline=None)
@given(deadline=moments, expires=moments, timeout=st.integers(min_value=1, max_value=3600),
       requester=st.emails(), policy_version=st.integers(min_value=1, max_value=10**6))
def test_key_ignores_everything_but_the_intent(deadline, expires, timeout, requester, policy_version):
    """Deadlines, expiry, timeouts, who asked and the policy version (and the clock at build time)
    change nothing: a retry of the same intent always carries the same key."""
    base = build_envelope(**fields())
    other = build_envelope(**fields(deadline=deadline, timeout_seconds=timeout, requester=requester,
                                    policy_version=policy_version,
                                    approval={"id": "apr-1", "version": 1, "expires_at": expires}))
    assert (other.idempotency_key, other.arguments_hash) == (base.idempotency_key, base.arguments_hash)


@pytest.mark.parametrize(
    "change",
    [
        {"tenant": "globex"},
        {"action_id": "act-2"},
        {"run_id": "run-2"},
        {"workflow_type": "agent.other"},
        {"target": {"type": "ticket_queue", "id": "billing"}},
        {"target": {"type": "other_queue", "id": "support"}},
        {"operation": "close"},
        {"arguments": {"tenant": "acme", "title": "Disk full!", "owner": "ops", "tags": ["disk", "p2"]}},
        {"arguments": {"tenant": "acme", "title": "Disk full", "owner": "ops", "tags": ["p2", "disk"]}},
        {"approval": {"id": "apr-1", "version": 2, "expires_at": datetime(2030, 1, 1, tzinfo=UTC)}},
    ],
    ids=lambda c: next(iter(c)),
)
def test_key_changes_with_each_part_of_the_intent(change):
    base = build_envelope(**fields())
    changed = build_envelope(**fields(**change))
    assert changed.idempotency_key != base.idempotency_key


def test_operation_is_normalised_before_hashing():
    assert (build_envelope(**fields(operation="  Create ")).idempotency_key
            == build_envelope(**fields()).idempotency_key)


@pytest.mark.parametrize("forbidden", ["idempotency_key", "arguments_hash"])
def test_build_refuses_caller_supplied_hashes(forbidden):
    with pytest.raises(ValueError, match=forbidden):
        build_envelope(**fields(**{forbidden: "pl1-chosen-by-a-model"}))


def test_model_is_frozen():
    env = build_envelope(**fields())
    with pytest.raises(ValidationError):
        env.idempotency_key = "pl1-other"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        env.target.id = "other"  # type: ignore[misc]
    assert env.idempotency_key == key_for(env)


def test_naive_deadline_refused():
    with pytest.raises(ValidationError, match="deadline"):
        build_envelope(**fields(deadline=datetime(2030, 1, 1)))


def test_naive_approval_expiry_refused():
    with pytest.raises(ValidationError, match="expires_at"):
        build_envelope(**fields(approval={"id": "apr-1", "version": 1, "expires_at": datetime(2030, 1, 1)}))


def test_extra_fields_refused():
    with pytest.raises(ValidationError, match="extra"):
        build_envelope(**fields(note="free text from a model"))
    with pytest.raises(ValidationError, match="extra"):
        build_envelope(**fields(target={"type": "ticket_queue", "id": "support", "owner": "x"}))


def test_roundtrip_through_json_keeps_the_key():
    env = build_envelope(**fields())
    again = Envelope.model_validate(json.loads(env.model_dump_json()))
    assert again == env
    assert key_for(again) == env.idempotency_key


def test_published_schema_equals_the_model():
    published = json.loads((ROOT / "schemas" / "envelope.v1.json").read_text())
    assert published == Envelope.model_json_schema()
