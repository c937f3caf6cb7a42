"""Questions servers asked and the answers approvers gave, on chains of their own
(``elicitation:<id>``, see ``proofline/elicitations.py``). Insert-only like every chain: a question
is pending until its chain holds an answer or an expiry, and a per-chain transaction lock makes those
two exclusive (an answer that arrives as the worker gives up is refused, never half-used)."""

from __future__ import annotations

from typing import Any

from ledger import store
from proofline.elicitations import ANSWERED, ASKED, CHAIN_PREFIX, EXPIRED, chain
from proofline.errors import ElicitationRefused

# Pending questions: the chain-key range of the unique (action_id, seq) index, then the exact prefix.
_PENDING = f"""SELECT q.action_id, q.evidence, q.at FROM ledger_events q
   WHERE q.action_id >= %(lo)s AND q.action_id < %(hi)s AND left(q.action_id, {len(CHAIN_PREFIX)}) = %(prefix)s
     AND q.event = 'elicitation_asked'
     AND NOT EXISTS (SELECT 1 FROM ledger_events d WHERE d.action_id = q.action_id
                     AND d.event IN ('elicitation_answered', 'elicitation_expired'))
   ORDER BY q.at"""


def ask_txn(cur: store.Cursor, elicitation_id: str, actor: str, question: dict[str, Any]) -> None:
    store.append_event_txn(cur, chain(elicitation_id), ASKED, actor, question)


def state(cur: store.Cursor, elicitation_id: str) -> dict[str, Any]:
    """``{"question", "asked_at", "answer" (the signed answer as recorded), "expired"}`` of one chain."""
    found: dict[str, Any] = {"question": None, "asked_at": None, "answer": None, "expired": False}
    for row in store.timeline(cur, chain(elicitation_id)):
        if row["event"] == ASKED and found["question"] is None:
            found["question"], found["asked_at"] = row["evidence"], row["at"]
        elif row["event"] == ANSWERED and found["answer"] is None:
            found["answer"] = row["evidence"].get("signed")
        elif row["event"] == EXPIRED:
            found["expired"] = True
    return found


def answer_txn(cur: store.Cursor, elicitation_id: str, signed: dict[str, Any], by: str) -> None:
    """Record a signed answer to a pending question (the caller has verified it)."""
    store.lock_chain_txn(cur, chain(elicitation_id))
    now = state(cur, elicitation_id)
    if now["question"] is None:
        raise ElicitationRefused(f"no elicitation {elicitation_id[:64]!r} was asked", elicitation_id=elicitation_id[:64])
    if now["answer"] is not None or now["expired"]:
        raise ElicitationRefused(f"elicitation {elicitation_id} is {'answered' if now['answer'] else 'expired'}",
                                 elicitation_id=elicitation_id)
    store.append_event_txn(cur, chain(elicitation_id), ANSWERED, by,
                           {"signed": signed, "action": signed["answer"]["action"]})


def expire_txn(cur: store.Cursor, elicitation_id: str, actor: str, waited_seconds: float) -> dict[str, Any] | None:
    """Give up on a question: records the expiry and returns None, or returns the signed answer that
    made it in first."""
    store.lock_chain_txn(cur, chain(elicitation_id))
    now = state(cur, elicitation_id)
    if now["answer"] is not None:
        return now["answer"]
    if not now["expired"]:
        store.append_event_txn(cur, chain(elicitation_id), EXPIRED, actor, {"waited_seconds": round(waited_seconds, 3)})
    return None


def pending(cur: store.Cursor) -> list[dict[str, Any]]:
    """Questions nobody has answered yet, oldest first."""
    cur.execute(_PENDING, {"lo": CHAIN_PREFIX, "hi": CHAIN_PREFIX[:-1] + chr(ord(CHAIN_PREFIX[-1]) + 1),
                           "prefix": CHAIN_PREFIX})
    return [{"elicitation_id": r["action_id"][len(CHAIN_PREFIX):], "question": r["evidence"], "asked_at": r["at"]}
            for r in cur.fetchall()]
