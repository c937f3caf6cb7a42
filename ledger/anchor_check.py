"""``verify-ledger``: every chain checked against itself and against the signed checkpoints.

The self-check (``proofline/ledger_check.py``) catches an event edited in place or removed without
recomputing the chain. The checkpoints catch what the self-check cannot: a chain rewritten with
recomputed hashes and a moved anchor, a chain deleted whole, a tail cut with the anchor moved back.
The checkpoint series itself is checked too: every file's signature (keyring's ledger keys), its
contents against the signed statement, its link to the previous one, and the ledger's own record of
every checkpoint written (a deleted newest file is missing from the store but not from the ledger).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from ledger.anchor_keys import load_public_keys
from ledger.anchor_store import store_for
from ledger.checkpoint import RECORD_CHAIN, Checkpoint, ledger_name, open_checkpoint, recorded_checkpoints
from ledger.pruned import PrunedHead, pruned_heads
from proofline.errors import CheckpointInvalid, LedgerKeyUnavailable
from proofline.ledger_check import BrokenLink, check_chains
from proofline.settings import Settings

#: The chain name under which problems with the checkpoint series are reported (seq = checkpoint number).
SERIES = "checkpoints"


@dataclass
class LedgerReport:
    chains: int
    events: int
    broken: list[BrokenLink]
    #: The checkpoint the chains were compared with (the newest that verifies), or None.
    checkpoint: dict[str, Any] | None
    checkpoints: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.broken

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "chains": self.chains, "events": self.events, "checkpoint": self.checkpoint,
                "checkpoints": self.checkpoints, "notes": self.notes,
                "broken": [{"chain": b.action_id, "seq": b.seq, "problem": b.problem} for b in self.broken]}


class _Expected:
    """Every event hash the valid checkpoints anchored, compared with the rows as they stream past."""

    def __init__(self, series: list[Checkpoint], pruned: dict[str, PrunedHead] | None = None) -> None:
        self.pruned = pruned or {}
        self.hashes: dict[str, list[str | None]] = {}
        #: chain -> ([last seq of each delta], [checkpoint number of each delta]) to cite the right one.
        self.owner: dict[str, tuple[list[int], list[int]]] = {}
        for cp in series:
            for chain, delta in sorted(cp.hashes.items()):
                known = self.hashes.setdefault(chain, [])
                start = int(delta["from"])
                known.extend([None] * (start - 1 - len(known)))  # a missing checkpoint leaves a gap
                del known[start - 1:]
                known.extend(delta["hashes"])
                ends, numbers = self.owner.setdefault(chain, ([], []))
                ends.append(len(known))
                numbers.append(cp.number)
        self.latest = series[-1] if series else None
        # The newest checkpoint's heads hold even where older checkpoints (and their hashes) are lost.
        for chain, seq, head in self.latest.leaves if self.latest else []:
            known = self.hashes.setdefault(chain, [])
            known.extend([None] * (seq - len(known)))
            known[seq - 1] = head
            ends, numbers = self.owner.setdefault(chain, ([], []))
            if not ends or ends[-1] < seq:
                ends.append(seq)
                numbers.append(self.latest.number)
        self.last_seen: dict[str, int] = {}
        self.problems: dict[str, BrokenLink] = {}

    def cited(self, chain: str, seq: int) -> int:
        ends, numbers = self.owner.get(chain, ([], []))
        i = bisect.bisect_left(ends, seq)
        return numbers[min(i, len(numbers) - 1)] if numbers else 0

    def _flag(self, chain: str, seq: int, problem: str) -> None:
        self.problems.setdefault(chain, BrokenLink(chain, seq, problem))

    def observe(self, row: dict[str, Any]) -> None:
        chain, seq = row["action_id"], row["seq"]
        last = self.last_seen.get(chain, 0)
        self.last_seen[chain] = seq
        known = self.hashes.get(chain)
        if not known or chain in self.problems:
            return
        for missing in range(last + 1, min(seq, len(known) + 1)):
            if known[missing - 1] is not None:
                self._flag(chain, missing, f"event {missing} anchored by checkpoint {self.cited(chain, missing)} "
                                           "is missing")
                return
        if seq <= len(known) and known[seq - 1] is not None and row["recomputed"] != known[seq - 1]:
            self._flag(chain, seq, f"event {seq} differs from the one checkpoint {self.cited(chain, seq)} anchored "
                                   "(rewritten, even if the chain was rehashed)")

    def finish(self) -> None:
        if self.latest is None:
            return
        for chain, seq, head in self.latest.leaves:
            seen = self.last_seen.get(chain, 0)
            kept = self.pruned.get(chain)
            if seen == 0 and kept is not None and (kept.seq, kept.head) == (seq, head):
                continue  # pruned whole at the head this checkpoint anchored: recorded, not deleted
            if seen == 0:
                self._flag(chain, 1, f"the whole chain ({seq} events anchored by checkpoint "
                                     f"{self.cited(chain, seq)}) was deleted")
            elif seen < seq:
                self._flag(chain, seen + 1, f"events {seen + 1}..{seq} anchored by checkpoint "
                                            f"{self.cited(chain, seq)} were removed (chain truncated)")


def _series(conn: Any, settings: Settings, notes: list[str]) -> tuple[list[Checkpoint], list[BrokenLink], int]:
    """The checkpoints that verify, in order; problems with the series; how many files the store holds."""
    ledger = ledger_name(conn)
    try:
        anchor = store_for(settings, ledger)
    except CheckpointInvalid as exc:
        return [], [BrokenLink(SERIES, 1, exc.detail)], 0
    numbers = anchor.list()
    problems: list[BrokenLink] = []
    with conn.cursor() as cur:
        cur.execute("SELECT EXISTS (SELECT 1 FROM ledger_events WHERE action_id = %s) AS any", (RECORD_CHAIN,))
        recorded = cur.fetchone()["any"]
    if not numbers and not recorded:
        notes.append(f"no checkpoint in {anchor.location}: chains are checked only against themselves")
        return [], problems, 0
    try:
        keys = load_public_keys(settings)
    except LedgerKeyUnavailable as exc:
        return [], [BrokenLink(SERIES, min(numbers or [1]), f"checkpoints cannot be verified: {exc.detail}")], \
            len(numbers)
    records = []
    for record in recorded_checkpoints(conn, keys):
        if record.number is None:
            # Anyone who may append to the ledger may append here: a record that is not one is named.
            problems.append(BrokenLink(RECORD_CHAIN, record.seq, record.problem or "not a checkpoint record"))
        else:
            records.append(record)
    valid: list[Checkpoint] = []
    by_number: dict[int, Checkpoint] = {}
    present = set(numbers)
    for number in range(1, max(numbers or [0]) + 1):
        if number not in present:
            problems.append(BrokenLink(SERIES, number, f"checkpoint {number} is missing from {anchor.location}"))
            continue
        try:
            cp = open_checkpoint(number, anchor.read(number), keys)
        except CheckpointInvalid as exc:
            problems.append(BrokenLink(SERIES, number, f"{exc.detail} (file in {anchor.location})"))
            continue
        if cp.statement.get("ledger") != ledger:
            problems.append(BrokenLink(SERIES, number, f"checkpoint {number} is of ledger "
                                                       f"{cp.statement.get('ledger')!r}, not {ledger!r}"))
            continue
        prev = cp.statement.get("prev")
        before = by_number.get(number - 1)
        if number > 1 and (before is None or prev != {"number": before.number, "hash": before.hash}):
            problems.append(BrokenLink(SERIES, number, f"checkpoint {number} does not extend checkpoint "
                                                       f"{number - 1} as stored (the series was altered)"))
        valid.append(cp)
        by_number[number] = cp
    for record in records:
        cp = by_number.get(record.number)
        where = f"recorded at {RECORD_CHAIN} seq {record.seq}"
        if record.number not in present:
            problems.append(BrokenLink(SERIES, record.number, f"checkpoint {record.number} ({where}) is missing from "
                                                              f"{anchor.location}"))
        elif cp is not None and cp.hash != record.hash:
            problems.append(BrokenLink(SERIES, record.number, f"checkpoint {record.number} in the store is not the "
                                                              f"one {where}"))
    return valid, problems, len(numbers)


def _prune_problems(pruned: dict[str, PrunedHead], series: list[Checkpoint]) -> list[BrokenLink]:
    """A prune record must name heads its checkpoint anchored: anything else is a deletion dressed up."""
    by_number = {cp.number: cp for cp in series}
    problems = []
    for kept in pruned.values():
        cp = by_number.get(kept.checkpoint)
        if cp is None:
            if series and kept.checkpoint > series[-1].number:
                problems.append(BrokenLink(kept.chain, kept.seq, f"pruned under checkpoint {kept.checkpoint}, "
                                                                 "which does not exist"))
            continue  # an older checkpoint that is missing is reported with the series
        if cp.heads().get(kept.chain) != (kept.seq, kept.head):
            problems.append(BrokenLink(kept.chain, kept.seq, f"pruned (ledger:prunes seq {kept.record_seq}) at a "
                                                             f"head checkpoint {kept.checkpoint} did not anchor"))
    return problems


def verify_ledger(conn: Any, settings: Settings) -> LedgerReport:
    notes: list[str] = []
    series, problems, stored = _series(conn, settings, notes)
    pruned = pruned_heads(conn)
    problems += _prune_problems(pruned, series)
    if pruned:
        notes.append(f"{len(pruned)} chain(s) pruned whole; their heads are kept in ledger:prunes")
    expected = _Expected(series, pruned)
    chains, events, broken = check_chains(conn, on_event=expected.observe)
    expected.finish()
    first: dict[str, BrokenLink] = {}
    for link in [*broken, *expected.problems.values(), *problems]:
        held = first.get(link.action_id)
        if held is None or link.seq < held.seq:
            first[link.action_id] = link
        elif link.seq == held.seq and link.problem != held.problem:
            first[link.action_id] = BrokenLink(link.action_id, link.seq, f"{held.problem}; {link.problem}")
    summary = None
    if expected.latest is not None:
        st = expected.latest.statement
        summary = {"number": st["number"], "hash": expected.latest.hash, "created_at": st["created_at"],
                   "key_id": st["key_id"], "chains": st["chains"], "events": st["events"]}
    return LedgerReport(chains, events, sorted(first.values(), key=lambda b: (b.action_id, b.seq)), summary,
                        stored, notes)
