"""Contract reads for agents: a governed action type's own read, answered by a worker.

The gateway (a controller) holds no MCP server credentials, so it never reads a system of record
itself. It records the agent's request on a chain of its own (``read:<request id>``, event
``read_requested``, which only the controller role may append), sends a ``proofline.read`` task
signed by its controller key, and polls the chain. A worker verifies the signature and that the
task is exactly the recorded request, runs the contract's precondition read through the server's
read identity with nothing but the target, checks the answer is the requesting tenant's with the
contract's own tenant precondition, and appends ``read_answered`` (the worker role's event) with
the extracted value, redacted by the policy and the contract's ``sensitive_fields``.

A read tool is offered only for a contract whose precondition read needs nothing but the target
(``target.id``) and whose preconditions say how ``before`` names its tenant (a precondition with
reason ``tenant_mismatch`` over ``before`` and ``envelope.tenant``): without that, an answer's
tenant could not be checked, and it is not offered.

A request's signature covers ``READ_CONTEXT`` and the request's canonical JSON: it is never a valid
envelope signature, and an envelope's is never a valid read signature.
"""

from __future__ import annotations

import base64
import binascii
import re
from datetime import UTC, datetime
from typing import Any

from cryptography.exceptions import InvalidSignature

from proofline.canonical import canonical_bytes
from proofline.contracts import Condition, Contract
from proofline.errors import ReadRefused
from proofline.keys import Keyring, KeyRole, PublicKey, SigningKey
from proofline.signing import signer

CHAIN_PREFIX = "read:"
REQUESTED, ANSWERED = "read_requested", "read_answered"
TASK = "proofline.read"
#: What a read request's signature covers: this prefix, then the request's canonical JSON.
READ_CONTEXT = b"proofline-read-v1\n"
#: The suffix of a read tool's name: ``ticket.close.read``.
SUFFIX = ".read"
#: Why an answer holds no value: the target is not the tenant's (or does not exist: the same answer,
#: so a read never tells one tenant what another has), or the read path could not answer.
NOT_FOUND, UNAVAILABLE = "target_not_found", "read_unavailable"
_OTHER_ROOTS = re.compile(r"\b(envelope|args|before|after|result|plan|operation)\b")
_TENANT_ROOTS = re.compile(r"\bbefore\b.*\benvelope\.tenant\b|\benvelope\.tenant\b.*\bbefore\b")


def chain(request_id: str) -> str:
    return f"{CHAIN_PREFIX}{request_id}"


def tenant_conditions(contract: Contract) -> tuple[Condition, ...]:
    """The contract's preconditions that say whose ``before`` is (reason ``tenant_mismatch``)."""
    return tuple(c for c in contract.preconditions
                 if c.reason == "tenant_mismatch" and _TENANT_ROOTS.search(c.expr))


def offers_read(contract: Contract) -> bool:
    """Whether agents may read this contract's target: its precondition read needs only the target,
    and its preconditions check the answer's tenant."""
    read = contract.precondition_read
    only_target = all("target" in expr and not _OTHER_ROOTS.search(expr) for expr in read.arguments.values())
    return bool(read.arguments) and only_target and bool(tenant_conditions(contract))


def sign_request(request: dict[str, Any], key: SigningKey) -> dict[str, Any]:
    """The ``proofline.read`` task's body: the request, the controller key's id and its signature."""
    if key.role != KeyRole.controller:
        raise ReadRefused(f"a {key.role.value} key may not ask for reads", role=key.role.value)
    signature = key.sign(READ_CONTEXT + canonical_bytes(request))
    return {"request": request, "key_id": key.key_id, "signature": base64.b64encode(signature).decode()}


def verify_request(message: Any, keyring: Keyring, now: datetime | None = None) -> tuple[dict[str, Any], PublicKey]:
    """The signed request and the controller key that signed it, or :class:`ReadRefused` with its cause."""
    def refuse(cause: str, detail: str) -> ReadRefused:
        return ReadRefused(detail, cause=cause)

    if not isinstance(message, dict) or not isinstance(message.get("request"), dict):
        raise refuse("malformed", "a read task is an object with a 'request' object")
    key_id, signature = message.get("key_id"), message.get("signature")
    if not isinstance(key_id, str) or not isinstance(signature, str) or not key_id or not signature:
        raise refuse("unsigned", "the read task has no signature or key id")
    key = signer(keyring, key_id, KeyRole.controller, "read task", refuse)
    if key.revoked or key.expired(now or datetime.now(UTC)):
        raise refuse("retired_key", f"read task signed with revoked or expired key {key_id}")
    try:
        raw = base64.b64decode(signature.encode("ascii"), validate=True)
        key.public.verify(raw, READ_CONTEXT + canonical_bytes(message["request"]))
    except (UnicodeEncodeError, binascii.Error, ValueError, InvalidSignature):
        raise refuse("bad_signature", "the read task's signature does not match its request") from None
    except Exception as exc:  # noqa: BLE001 - rfc8785 refuses NaN, huge ints, non-str keys
        raise refuse("malformed", f"the read request is not canonicalisable JSON: {exc}"[:300]) from None
    return message["request"], key
