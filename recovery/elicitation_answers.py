"""An approver's side of a server's elicitation: list the questions waiting, answer one.

The answer is signed with the approver's key and verified as the worker will verify it before it is
recorded, so a wrong key, a stale question or content outside the requested schema is refused here,
with its reason, and nothing is recorded (``proofline/elicitations.py``)."""

from __future__ import annotations

from typing import Any

from ledger import elicitations as book
from ledger import store
from proofline.elicitations import answer_for, sign_answer
from proofline.errors import ElicitationRefused
from proofline.keys import KeyRole, SigningKey, load_keyring
from proofline.settings import Settings


def waiting(conn: Any) -> list[dict[str, Any]]:
    with conn.cursor() as cur:
        return book.pending(cur)


def show(conn: Any, elicitation_id: str) -> dict[str, Any]:
    with conn.cursor() as cur:
        found = book.state(cur, elicitation_id)
    if found["question"] is None:
        raise ElicitationRefused(f"no elicitation {elicitation_id[:64]!r} was asked", elicitation_id=elicitation_id[:64])
    answer = (found["answer"] or {}).get("answer") if isinstance(found["answer"], dict) else None
    return {"elicitation_id": elicitation_id, "question": found["question"], "asked_at": found["asked_at"],
            "state": "answered" if answer else "expired" if found["expired"] else "pending",
            "answer": {k: answer.get(k) for k in ("action", "approver", "issued_at")} if answer else None}


def answer(settings: Settings, conn: Any, elicitation_id: str, key: SigningKey, *, accept: bool,
           content: dict[str, Any] | None = None) -> dict[str, Any]:
    """Sign and record an answer to a pending question; :class:`ElicitationRefused` otherwise."""
    keyring = load_keyring(settings.keyring_file, settings.environment)
    entry = keyring.get(key.key_id)
    if entry is None or entry.role != KeyRole.approver or entry.revoked:
        raise ElicitationRefused(f"key {key.key_id} is not an active approver key in the keyring", key_id=key.key_id)
    identity = entry.identity or entry.key_id
    with store.transaction(conn) as cur:
        question = book.state(cur, elicitation_id)["question"]
        if question is None:
            raise ElicitationRefused(f"no elicitation {elicitation_id[:64]!r} was asked",
                                     elicitation_id=elicitation_id[:64])
        # answer_for checks the content against the schema; the key's role and state were checked above.
        signed = sign_answer(answer_for(question, elicitation_id=elicitation_id, approver=identity, accept=accept,
                                        content=content), key)
        book.answer_txn(cur, elicitation_id, signed, identity)
    return {"elicitation_id": elicitation_id, "action_id": question.get("action_id"),
            "action": signed["answer"]["action"], "approver": identity}
