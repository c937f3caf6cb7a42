"""Recovery authority without services: authenticating a stored action row against its signed
message, and the executing worker's check of a recovery envelope's parent link."""

from __future__ import annotations

import base64
import dataclasses
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from ledger.states import ActionStatus
from ledger.store import ActionRow
from proofline.contracts import contract_for
from proofline.envelope import Envelope
from proofline.errors import ParentLinkInvalid, ParentRowMismatch, ParentSignatureInvalid
from proofline.keys import Keyring, KeyRole, SigningKey, generate, load_keyring, load_signing_key
from proofline.settings import ROOT
from proofline.signing import message_hash, sign
from tests.unit.test_signing import derived, envelope
from worker.validate import authenticate_row, check_parent_link

lookup = partial(contract_for, ROOT / "contracts")


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[SigningKey, SigningKey, Keyring]:
    d: Path = tmp_path_factory.mktemp("keys")
    generate(d)
    return (load_signing_key(d / "controller.key", KeyRole.controller),
            load_signing_key(d / "recovery.key", KeyRole.recovery), load_keyring(d / "keyring.json"))


def row_for(message: dict[str, Any], **columns: Any) -> ActionRow:
    env = Envelope.model_validate(message["envelope"])
    fields: dict[str, Any] = {
        "action_id": env.action_id, "run_id": env.run_id, "step": env.step, "tenant": env.tenant,
        "action_type": env.action_type, "tool": env.tool.name, "idempotency_key": env.idempotency_key,
        "status": ActionStatus.recovery, "outcome": None, "finding": "prohibited", "reason_code": None,
        "envelope": message["envelope"], "result": None, "recovery_data": {}, "deadline": env.deadline,
        "published_at": datetime.now(UTC), "updated_at": datetime.now(UTC), "key_id": message["key_id"],
        "signature": message["signature"]}
    fields.update(columns)
    return ActionRow(**fields)


def test_a_genuine_row_authenticates(keys) -> None:
    controller, _, ring = keys
    env = envelope()
    assert authenticate_row(row_for(sign(env, controller)), ring, KeyRole.controller) == env


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"signature": None}, ParentSignatureInvalid),
        ({"signature": base64.b64encode(b"\0" * 64).decode()}, ParentSignatureInvalid),
        ({"key_id": "dev-1"}, ParentSignatureInvalid),
        ({"tenant": "globex"}, ParentRowMismatch),
        ({"action_id": "another"}, ParentRowMismatch),
        ({"action_type": "ticket.close"}, ParentRowMismatch),
        ({"idempotency_key": "pl1-" + "0" * 48}, ParentRowMismatch),
        ({"tool": "close_ticket"}, ParentRowMismatch),
    ],
    ids=["unsigned", "bad-signature", "unknown-key", "tenant", "action-id", "action-type", "key", "tool"],
)
def test_a_forged_or_edited_row_is_refused(keys, change: dict[str, Any], error: type) -> None:
    controller, _, ring = keys
    with pytest.raises(error):
        authenticate_row(row_for(sign(envelope(), controller), **change), ring, KeyRole.controller)


@dataclasses.dataclass(frozen=True)
class SplitRow(ActionRow):
    """A row whose signed message is stored apart from its (redacted) envelope copy."""

    original: dict[str, Any] | None = None

    @property
    def signed_message(self) -> dict[str, Any] | None:
        return self.original


def test_an_edited_target_in_the_row_copy_is_a_mismatch(keys) -> None:
    controller, _, ring = keys
    message = sign(envelope(), controller)
    base = dataclasses.asdict(row_for(message))
    copy = {**message["envelope"], "target": {"type": "ticket_queue", "id": "globex-ops"}}
    with pytest.raises(ParentRowMismatch, match="differs") as info:
        authenticate_row(SplitRow(**{**base, "envelope": copy}, original=message), ring, KeyRole.controller)
    assert set(info.value.context["mismatches"]) == {"target"}
    hostile = {**message["envelope"], "target": {"id": 2**70}}  # not even canonicalisable: no crash
    with pytest.raises(ParentRowMismatch):
        authenticate_row(SplitRow(**{**base, "envelope": hostile}, original=message), ring, KeyRole.controller)
    # With today's single column, editing the copy breaks the signature itself.
    with pytest.raises(ParentSignatureInvalid):
        authenticate_row(row_for(message, envelope=copy), ring, KeyRole.controller)


def test_a_row_signed_by_the_wrong_role_is_refused(keys) -> None:
    controller, recovery, ring = keys
    with pytest.raises(ParentSignatureInvalid):
        authenticate_row(row_for(sign(envelope(), controller)), ring, KeyRole.recovery)


def _link(keys, **overrides: Any) -> tuple[Envelope, ActionRow]:
    controller, _, _ = keys
    parent_message = sign(envelope(), controller)
    fields = {"parent_message_hash": message_hash(parent_message), **overrides}
    return derived(**fields), row_for(parent_message)


def test_a_correct_parent_link_passes(keys) -> None:
    env, parent = _link(keys)
    assert check_parent_link(env, parent, keys[2], lookup) == {
        "parent": "act-1", "kind": "compensation", "parent_message_hash": env.parent_message_hash,
        "parent_action_type": "ticket.create"}


@pytest.mark.parametrize(
    ("overrides", "parent_change", "reason"),
    [
        ({"parent_message_hash": "0" * 64}, {}, "parent_hash_mismatch"),
        ({"tenant": "globex"}, {}, "tenant_mismatch"),
        ({"action_id": "act-1.rollback"}, {}, "recovery_not_declared"),
        ({"action_type": "ticket.create", "operation": "create", "target": {"type": "ticket_queue", "id": "q"},
          "tool": {"name": "create_ticket", "contract_hash": "b" * 64}}, {}, "recovery_not_declared"),
        ({}, {"signature": None}, "parent_signature_invalid"),
        ({}, {"tenant": "globex"}, "parent_row_mismatch"),
        ({}, None, "parent_missing"),
    ],
    ids=["hash", "tenant", "kind", "type", "parent-unsigned", "parent-edited", "parent-missing"],
)
def test_a_wrong_parent_link_is_refused(keys, overrides: dict[str, Any], parent_change: dict | None,
                                        reason: str) -> None:
    env, parent = _link(keys, **overrides)
    row = None if parent_change is None else dataclasses.replace(parent, **parent_change)
    with pytest.raises(ParentLinkInvalid) as info:
        check_parent_link(env, row, keys[2], lookup)
    assert info.value.code == "envelope_parent_link_invalid" and info.value.context["reason"] == reason
