"""A server's question, put to a human: elicitations answered by approvers.

A tool server may ask its client, mid-call, to put a question to the user (``elicitation/create``,
form mode). Proofline refuses that by default; a servers file (narrowed by the contract) may instead
say ``elicitation: approver``. The worker then records the question on a chain of its own
(``elicitation:<id>``: the server, the action whose call is in flight, the message and the schema
the answer must meet) and holds the call open for at most ``elicitation_wait_seconds``. An approver
answers it (``proofline elicitations answer``): accept with content, or decline. The answer is a
statement signed by the approver's key and bound to the elicitation id, the action and the question
(its hash), so neither a database row nor another question can be passed off as the approver's word.
The worker verifies it again before anything reaches the server; nobody answering in time is
answered ``cancel``.

This module holds what both sides agree on: the statement, its signature and the checks of an
answer against its question.
"""

from __future__ import annotations

import base64
import hashlib
from datetime import UTC, datetime
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proofline.canonical import canonical_bytes
from proofline.errors import ElicitationRefused
from proofline.keys import Keyring, KeyRole, SigningKey
from proofline.signing import encode_signature, signer

#: The ledger chain a question and its answer are recorded on.
CHAIN_PREFIX = "elicitation:"
ASKED, ANSWERED, EXPIRED = "elicitation_asked", "elicitation_answered", "elicitation_expired"
#: Signatures over answers are domain-separated from every other signed document.
_CONTEXT = b"proofline-elicitation-answer\x00"
#: The longest question or schema a worker records (a hostile server's question is bounded).
MAX_QUESTION_BYTES = 16_384


def chain(elicitation_id: str) -> str:
    return f"{CHAIN_PREFIX}{elicitation_id}"


def question_hash(question: dict[str, Any]) -> str:
    """The hash an answer is bound to: the canonical JSON of the recorded question."""
    return hashlib.sha256(canonical_bytes(question)).hexdigest()


class ElicitationAnswer(BaseModel):
    """What an approver says to one question."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    elicitation_id: str = Field(min_length=1, max_length=64)
    action_id: str = Field(min_length=1, max_length=200)
    question_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    action: Literal["accept", "decline"]
    content: dict[str, Any] | None = None
    approver: str = Field(min_length=1, max_length=200)
    issued_at: datetime


def answer_for(question: dict[str, Any], *, elicitation_id: str, approver: str, accept: bool,
               content: dict[str, Any] | None = None) -> ElicitationAnswer:
    """An approver's answer to ``question`` (as recorded), checked against its requested schema."""
    answer = ElicitationAnswer(elicitation_id=elicitation_id, action_id=str(question.get("action_id")),
                               question_hash=question_hash(question), action="accept" if accept else "decline",
                               content=content if accept else None, approver=approver, issued_at=datetime.now(UTC))
    check_content(answer, question)
    return answer


def check_content(answer: ElicitationAnswer, question: dict[str, Any]) -> None:
    """An accepted answer's content must meet the schema the server asked for."""
    if answer.action != "accept":
        return
    import jsonschema  # reads its metaschemas from disk: not at the domain's import

    if answer.content is None:
        raise ElicitationRefused("an accepted answer carries content", elicitation_id=answer.elicitation_id)
    schema = question.get("requested_schema") or {"type": "object"}
    try:
        jsonschema.validate(answer.content, schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ElicitationRefused(f"content does not meet the requested schema at {where}: {exc.message[:200]}",
                                 elicitation_id=answer.elicitation_id, path=where) from None
    except jsonschema.SchemaError as exc:
        raise ElicitationRefused(f"the server's requested schema is not a JSON Schema: {exc.message[:200]}",
                                 elicitation_id=answer.elicitation_id) from None


def sign_answer(answer: ElicitationAnswer, key: SigningKey) -> dict[str, Any]:
    """``{"answer", "key_id", "signature"}``; only approver keys answer."""
    if key.role != KeyRole.approver:
        raise ElicitationRefused(f"a {key.role.value} key may not answer elicitations", key_id=key.key_id)
    document = answer.model_dump(mode="json")
    return {"answer": document, "key_id": key.key_id,
            "signature": encode_signature(key.sign(_CONTEXT + canonical_bytes(document)))}


def verify_answer(signed: Any, keyring: Keyring, *, elicitation_id: str, question: dict[str, Any]) -> ElicitationAnswer:
    """The answer ``signed`` carries, once its approver key, its binding to this question and its
    content are checked; :class:`ElicitationRefused` naming what is wrong otherwise."""
    if not isinstance(signed, dict) or not isinstance(signed.get("answer"), dict):
        raise ElicitationRefused("an answer is an object with an 'answer' statement", elicitation_id=elicitation_id)
    key_id, signature = signed.get("key_id"), signed.get("signature")
    if not isinstance(key_id, str) or not isinstance(signature, str):
        raise ElicitationRefused("an answer carries a key_id and a signature", elicitation_id=elicitation_id)
    key = signer(keyring, key_id, KeyRole.approver, "answer",
                 lambda cause, detail: ElicitationRefused(detail, elicitation_id=elicitation_id, cause=cause))
    if key.revoked:
        raise ElicitationRefused(f"answer signed with revoked key {key_id}", elicitation_id=elicitation_id,
                                 cause="revoked_key")
    try:
        key.public.verify(base64.b64decode(signature, validate=True), _CONTEXT + canonical_bytes(signed["answer"]))
        answer = ElicitationAnswer.model_validate(signed["answer"])
    except InvalidSignature:
        raise ElicitationRefused("answer signature does not match its statement", elicitation_id=elicitation_id) from None
    except (ValidationError, ValueError, TypeError) as exc:
        raise ElicitationRefused(f"answer cannot be verified: {str(exc)[:200]}", elicitation_id=elicitation_id) from None
    identity = key.identity or key.key_id
    wrong = [name for name, ok in (("approver", answer.approver == identity),
                                   ("elicitation_id", answer.elicitation_id == elicitation_id),
                                   ("action_id", answer.action_id == question.get("action_id")),
                                   ("question_hash", answer.question_hash == question_hash(question))) if not ok]
    if wrong:
        raise ElicitationRefused(f"answer does not match its question: {', '.join(wrong)}",
                                 elicitation_id=elicitation_id, fields=",".join(wrong))
    check_content(answer, question)
    return answer
