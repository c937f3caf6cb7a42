"""Verify every hash chain in the ledger and name the first broken link of each broken chain.

The check recomputes each event's hash with the same SQL function the insert trigger used and
checks that each event points at its predecessor's hash and that sequence numbers have no gaps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_CHECK_SELECT = """
SELECT action_id, seq, hash, prev_hash,
       ledger_event_hash(prev_hash, action_id, seq, event, actor, at, evidence) AS recomputed,
       lag(hash) OVER w AS previous_hash, lag(seq) OVER w AS previous_seq
FROM ledger_events {where}
WINDOW w AS (PARTITION BY action_id ORDER BY seq)
ORDER BY action_id, seq
"""
CHECK_SQL = _CHECK_SELECT.format(where="")
#: The same check on one chain (``%s``: its id); the window is per chain, so the result is equal.
CHAIN_CHECK_SQL = _CHECK_SELECT.format(where="WHERE action_id = %s")


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
        # Anchors first, events second: each statement reads its own snapshot, so an event appended
        # in between makes a chain longer than its anchor (checked at the anchored seq below), never
        # shorter (which would read as removed events).
        cur.execute("SELECT action_id, ledger_seq, ledger_head FROM actions WHERE ledger_seq > 0")
        anchors = {row["action_id"]: row for row in cur}
        cur.execute(CHECK_SQL)
        for row in cur:
            events += 1
            action_id = row["action_id"]
            chains.add(action_id)
            anchor = anchors.get(action_id)
            if anchor is None or row["seq"] <= anchor["ledger_seq"]:
                heads[action_id] = (row["seq"], row["hash"])  # the last event up to the anchor
            if on_event is not None:
                on_event(row)
            problem = None if action_id in broken else link_problem(row)
            if problem:
                broken[action_id] = BrokenLink(action_id, row["seq"], problem)
        # Each action row anchors its chain's head: a chain that ends early lost its last events.
        for action_id, anchor in anchors.items():
            if action_id not in broken:
                gap = head_problem(action_id, heads.get(action_id, (0, "")), anchor)
                if gap is not None:
                    broken[action_id] = gap
    return len(chains), events, sorted(broken.values(), key=lambda b: b.action_id)


def link_problem(row: dict[str, Any]) -> str | None:
    """What is wrong with one event row of ``CHECK_SQL`` (seq gap, wrong link, altered content)."""
    if row["seq"] != (row["previous_seq"] or 0) + 1:
        return f"sequence jumps from {row['previous_seq']} to {row['seq']} (an event was removed)"
    if row["prev_hash"] != (row["previous_hash"] or ""):
        return "prev_hash does not match the previous event's hash"
    if row["recomputed"] != row["hash"]:
        return "content does not match its hash (the event was altered)"
    return None


def head_problem(action_id: str, head: tuple[int, str], anchor: dict[str, Any]) -> BrokenLink | None:
    """Whether a chain's last event (seq, hash) is the head its action row anchored."""
    seq, last = head
    if seq < anchor["ledger_seq"]:
        return BrokenLink(action_id, seq + 1, f"events {seq + 1}..{anchor['ledger_seq']} were removed (the "
                          "chain ends before its anchored head)")
    if seq == anchor["ledger_seq"] and last != anchor["ledger_head"]:
        return BrokenLink(action_id, seq, "the last event differs from the anchored head")
    return None


def check_chain(cur: Any, action_id: str) -> tuple[int, BrokenLink | None]:
    """One chain: (events, its first broken link or None), by the same rules as :func:`check_chains`."""
    # The anchor before the events, as in check_chains: a concurrent append only lengthens the chain.
    cur.execute("SELECT ledger_seq, ledger_head FROM actions WHERE action_id = %s AND ledger_seq > 0", (action_id,))
    anchor = cur.fetchone()
    cur.execute(CHAIN_CHECK_SQL, (action_id,))
    rows = list(cur.fetchall())
    for row in rows:
        problem = link_problem(row)
        if problem:
            return len(rows), BrokenLink(action_id, row["seq"], problem)
    upto = [r for r in rows if anchor is None or r["seq"] <= anchor["ledger_seq"]]
    head = (upto[-1]["seq"], upto[-1]["hash"]) if upto else (0, "")
    return len(rows), head_problem(action_id, head, anchor) if anchor else None
