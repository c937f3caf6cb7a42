"""The reconciler's part of the post-condition re-checks: take the due ones, send them to workers.

Inside the sweep's one transaction (``recovery/reconciler.py``): the re-checks whose horizon
passed unread are marked ``expired``, and those due now (or whose claim expired: the worker that
had it died) are claimed with ``FOR UPDATE SKIP LOCKED``, each with a ``recheck_claimed`` event on
its action's chain. Only once the sweep committed is each sent (:func:`send`), as a
``proofline.recheck`` task naming the row and the claim's attempt; nothing waits in the broker
for its time (no ETA, no countdown): the schedule is the table. A re-check not yet due costs the
sweep one index read of ``postcondition_checks_open_idx`` in a transaction it runs anyway: no
commit, no message, no worker time.
"""

from __future__ import annotations

from typing import Any

from ledger import rechecks, store
from worker.dispatch import Dispatch


def take_txn(cur: store.Cursor, actor: str, *, limit: int, claim_seconds: float) -> tuple[list[dict[str, Any]], int]:
    """Expire what outlived its horizon and claim what is due; returns the claimed rows and how
    many expired. Events go on each action's chain in the caller's transaction."""
    expired = rechecks.expire_txn(cur, limit)
    for row in expired:
        store.append_event_txn(cur, row["action_id"], "recheck_expired", actor,
                               {"recheck": row["seq"], "recheck_key": row["recheck_key"], "attempts": row["attempts"]})
    claimed = rechecks.claim_due_txn(cur, limit, claim_seconds)
    for row in claimed:
        store.append_event_txn(cur, row["action_id"], "recheck_claimed", actor,
                               {"recheck": row["seq"], "recheck_key": row["recheck_key"], "attempt": row["attempts"],
                                "offset_seconds": row["offset_ms"] / 1000, "by": "reconciler"})
    return claimed, len(expired)


def send(dispatch: Dispatch, claimed: list[dict[str, Any]]) -> None:
    """Send each claimed re-check to a worker (after the sweep's commit)."""
    for row in claimed:
        dispatch.recheck(row["id"], row["attempts"], row.get("tenant"))
