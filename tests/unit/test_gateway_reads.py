"""Which contracts offer agents a read, and the read task's signature (no services)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from proofline.contracts import contract_for
from proofline.errors import ReadRefused
from proofline.keys import Keyring, KeyRole, PublicKey, SigningKey
from proofline.reads import offers_read, sign_request, verify_request
from proofline.settings import ROOT
from proofline.signing import sign_document

REQUEST = {"request_id": "r1", "tenant": "acme", "action_type": "ticket.close", "target": {"type": "ticket", "id": "t"}}


def key(role: KeyRole, revoked: bool = False) -> tuple[SigningKey, PublicKey]:
    private = Ed25519PrivateKey.generate()
    kid = f"{role.value}-{id(private)}"
    return SigningKey(kid, role, private), PublicKey(kid, role, private.public_key(), revoked=revoked)


def cause(message: object, keyring: Keyring) -> str:
    with pytest.raises(ReadRefused) as refused:
        verify_request(message, keyring)
    return str(refused.value.context["cause"])


@pytest.mark.parametrize(("action_type", "offered"), [("ticket.close", True), ("refund.issue", True),
                                                      ("ticket.create", False)])
def test_only_a_target_only_read_with_a_tenant_check_is_offered(action_type: str, offered: bool) -> None:
    # ticket.create reads by the envelope's idempotency key: nothing an agent's target could name.
    assert offers_read(contract_for(Path(ROOT) / "contracts", action_type)) is offered


def test_a_read_task_verifies_only_as_signed_by_a_controller_key() -> None:
    controller, controller_pub = key(KeyRole.controller)
    worker, worker_pub = key(KeyRole.worker)
    revoked, revoked_pub = key(KeyRole.controller, revoked=True)
    keyring = Keyring({k.key_id: k for k in (controller_pub, worker_pub, revoked_pub)})
    signed = sign_request(REQUEST, controller)
    assert verify_request(signed, keyring) == (REQUEST, controller_pub)
    assert cause({"request": REQUEST}, keyring) == "unsigned"
    assert cause({**signed, "request": {**REQUEST, "tenant": "beta"}}, keyring) == "bad_signature"
    assert cause({**signed, "key_id": "nobody"}, keyring) == "unknown_key"
    assert cause(sign_request(REQUEST, revoked), keyring) == "retired_key"
    # The same key's envelope signature over the same document is not a read signature.
    as_envelope = sign_document(REQUEST, controller)
    assert cause({"request": REQUEST, "key_id": controller.key_id, "signature": as_envelope["signature"]},
                 keyring) == "bad_signature"
    forged = {"request": REQUEST, "key_id": worker.key_id,
              "signature": sign_request(REQUEST, controller)["signature"]}
    assert cause(forged, keyring) == "wrong_key_role"
    with pytest.raises(ReadRefused):
        sign_request(REQUEST, worker)
