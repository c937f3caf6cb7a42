"""Agents' contract reads on chains of their own (``read:<request id>``, see ``proofline/reads.py``).

Insert-only like every chain: the controller role appends the request (``read_requested``), the
worker role the answer (``read_answered``); the database's event rights enforce who writes which
(migration 0023). A per-chain transaction lock makes the answer single: a second delivery of the
same task finds the request answered and writes nothing."""

from __future__ import annotations

import hashlib
from typing import Any

from ledger import store
from proofline.canonical import canonical_bytes
from proofline.errors import ReadRefused
from proofline.reads import ANSWERED, REQUESTED, chain

#: The key of the recorded request's evidence that holds the digest of the request as signed.
DIGEST_KEY = "request_digest"


def request_digest(request: dict[str, Any]) -> str:
    """The digest of ``request``'s canonical bytes (what the controller key signs)."""
    return "sha256:" + hashlib.sha256(canonical_bytes(request)).hexdigest()


def request_txn(cur: store.Cursor, request: dict[str, Any], actor: str) -> None:
    """Record an agent's read request (the controller role's write), with the digest of the request
    as signed: the stored copy is redacted like every event (a target id or a request id that looks
    like a card number is masked), so only the digest says which request was recorded."""
    store.append_event_txn(cur, chain(request["request_id"]), REQUESTED, actor,
                           {**request, DIGEST_KEY: request_digest(request)})


def is_recorded(recorded: dict[str, Any] | None, request: dict[str, Any]) -> bool:
    """Whether ``recorded`` (a chain's request evidence, or None) is ``request``: by the digest it
    holds; a request recorded before digests were, by its bytes."""
    if recorded is None:
        return False
    digest = recorded.get(DIGEST_KEY)
    if isinstance(digest, str):
        return digest == request_digest(request)
    return canonical_bytes(recorded) == canonical_bytes(request)


def state(cur: store.Cursor, request_id: str) -> dict[str, Any]:
    """``{"request", "answer"}`` of one read's chain (either None when not recorded)."""
    found: dict[str, Any] = {"request": None, "answer": None}
    for row in store.timeline(cur, chain(request_id)):
        if row["event"] not in (REQUESTED, ANSWERED):
            continue
        key = "request" if row["event"] == REQUESTED else "answer"
        if found[key] is None:
            found[key] = row["evidence"]
    return found


def answer_txn(cur: store.Cursor, request_id: str, answer: dict[str, Any], actor: str) -> None:
    """Record the answer to a recorded, unanswered request (the worker role's write). ``answer`` is
    stored as given: the caller has redacted it."""
    store.lock_chain_txn(cur, chain(request_id))
    now = state(cur, request_id)
    if now["request"] is None:
        raise ReadRefused(f"no read {request_id[:64]!r} was requested", cause="not_requested")
    if now["answer"] is not None:
        raise ReadRefused(f"read {request_id} is answered already", cause="answered")
    store.append_event_txn(cur, chain(request_id), ANSWERED, actor, answer)
