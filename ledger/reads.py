"""Agents' contract reads on chains of their own (``read:<request id>``, see ``proofline/reads.py``).

Insert-only like every chain: the controller role appends the request (``read_requested``), the
worker role the answer (``read_answered``); the database's event rights enforce who writes which
(migration 0023). A per-chain transaction lock makes the answer single: a second delivery of the
same task finds the request answered and writes nothing."""

from __future__ import annotations

from typing import Any

from ledger import store
from proofline.errors import ReadRefused
from proofline.reads import ANSWERED, REQUESTED, chain


def request_txn(cur: store.Cursor, request: dict[str, Any], actor: str) -> None:
    """Record an agent's read request (the controller role's write)."""
    store.append_event_txn(cur, chain(request["request_id"]), REQUESTED, actor, request)


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
