"""What the ledger says was pruned: the ``ledger_pruned`` events on the chain ``ledger:prunes``.

Each event lists the head ``[chain, seq, hash]`` of every chain it removed and the number of the
checkpoint that anchored those heads. ``verify-ledger`` reads them to tell a pruned chain (its
checkpointed head recorded here) from a deleted one, and the next checkpoint reads them to stop
carrying a pruned chain's leaf. Only the owner's ``proofline_prune()`` appends these events (their
event right is nobody's), and checkpoints anchor them like any other chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledger.retention_ddl import PRUNE_CHAIN, PRUNE_EVENT


@dataclass(frozen=True)
class PrunedHead:
    chain: str
    seq: int
    head: str
    #: The checkpoint whose leaf was this head when the chain was pruned.
    checkpoint: int
    #: The seq of the ``ledger_pruned`` event on ``ledger:prunes`` that records it.
    record_seq: int


def pruned_heads(conn: Any) -> dict[str, PrunedHead]:
    """Every pruned chain's kept head, by chain (a chain pruned twice keeps its last record)."""
    heads: dict[str, PrunedHead] = {}
    with conn.cursor() as cur:
        cur.execute("SELECT seq, evidence FROM ledger_events WHERE action_id = %s AND event = %s ORDER BY seq",
                    (PRUNE_CHAIN, PRUNE_EVENT))
        for row in cur:
            evidence = row["evidence"] if isinstance(row["evidence"], dict) else {}
            number = evidence.get("checkpoint")
            for item in evidence.get("heads") or []:
                try:
                    chain, seq, head = str(item[0]), int(item[1]), str(item[2])
                except (TypeError, ValueError, IndexError):
                    continue
                heads[chain] = PrunedHead(chain, seq, head, int(number or 0), row["seq"])
    return heads
