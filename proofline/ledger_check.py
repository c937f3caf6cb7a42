"""Verify every hash chain in the ledger and name the first broken link of each broken chain.

The check recomputes each event's hash with the same SQL function the insert trigger used and
checks that each event points at its predecessor's hash and that sequence numbers have no gaps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CHECK_SQL = """
SELECT action_id, seq, hash, prev_hash,
       ledger_event_hash(prev_hash, action_id, seq, event, actor, at, evidence) AS recomputed,
       lag(hash) OVER w AS previous_hash, lag(seq) OVER w AS previous_seq
FROM ledger_events
WINDOW w AS (PARTITION BY action_id ORDER BY seq)
ORDER BY action_id, seq
"""


@dataclass(frozen=True)
class BrokenLink:
    action_id: str
    seq: int
    problem: str


def check_chains(conn: Any, on_event: Callable[[dict[str, Any]], None] | None = None,
                 ) -> tuple[int, int, list[BrokenLink]]:
    """Returns (chains, events, first broken link of each broken chain). ``on_event`` sees every
    event row (with its ``recomputed`` hash) in chain order, so other checks need no second pass."""
    broken: dict[str, BrokenLink] = {}
    chains: set[str] = set()
    heads: dict[str, tuple[int, str]] = {}
    events = 0
    with conn.cursor() as cur:
        cur.execute(CHECK_SQL)
        for row in cur:
            events += 1
            action_id = row["action_id"]
            chains.add(action_id)
            heads[action_id] = (row["seq"], row["hash"])
            if on_event is not None:
                on_event(row)
            if action_id in broken:
                continue
            expected_seq = (row["previous_seq"] or 0) + 1
            expected_prev = row["previous_hash"] or ""
            problem = None
            if row["seq"] != expected_seq:
                problem = f"sequence jumps from {row['previous_seq']} to {row['seq']} (an event was removed)"
            elif row["prev_hash"] != expected_prev:
                problem = "prev_hash does not match the previous event's hash"
            elif row["recomputed"] != row["hash"]:
                problem = "content does not match its hash (the event was altered)"
            if problem:
                broken[action_id] = BrokenLink(action_id, row["seq"], problem)
        # Each action row anchors its chain's head: a chain that ends early lost its last events.
        cur.execute("SELECT action_id, ledger_seq, ledger_head FROM actions WHERE ledger_seq > 0")
        for row in cur:
            action_id = row["action_id"]
            if action_id in broken:
                continue
            seq, head = heads.get(action_id, (0, ""))
            if seq < row["ledger_seq"]:
                broken[action_id] = BrokenLink(action_id, seq + 1, f"events {seq + 1}..{row['ledger_seq']} were "
                                               "removed (the chain ends before its anchored head)")
            elif seq == row["ledger_seq"] and head != row["ledger_head"]:
                broken[action_id] = BrokenLink(action_id, seq, "the last event differs from the anchored head")
    return len(chains), events, sorted(broken.values(), key=lambda b: b.action_id)
