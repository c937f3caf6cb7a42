"""Signed checkpoints of the whole ledger, kept outside Postgres.

The hash chains in ``ledger_events`` only prove that a chain agrees with itself: whoever owns the
table can rewrite an event, recompute every later hash and move the anchor on ``actions``. A
checkpoint closes that gap. It reads every chain's head from ``ledger_events`` itself, commits to
all of them in a Merkle root, chains itself to the previous checkpoint, is signed with the ledger's
Ed25519 key and is appended to a store the database cannot write to. It also stores the hash of
every event anchored since the previous checkpoint, so a later check names the exact first event
that changed.

A checkpoint never blesses a chain that no longer extends what the previous checkpoint anchored
(rewritten, truncated or deleted since): it carries that chain's previous leaf forward unchanged
and lists the chain as ``diverged``. Each event is content-checked (its hash recomputed) once, when
it first enters a checkpoint.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from cryptography.exceptions import InvalidSignature

from ledger import store
from ledger.anchor_keys import PublicKey, SigningKey, load_public_keys, load_signing_key
from ledger.anchor_store import AnchorStore, store_for
from ledger.pruned import pruned_heads
from proofline.canonical import canonical_bytes
from proofline.errors import CheckpointInvalid, LedgerKeyUnavailable
from proofline.keys import KeyRole
from proofline.settings import Settings

log = logging.getLogger(__name__)

FORMAT = "proofline-ledger-checkpoint/1"
#: The ledger chain on which each written checkpoint is recorded: the database and the store each
#: hold evidence of the other, so removing the newest checkpoint file does not go unnoticed.
RECORD_CHAIN = "ledger:checkpoints"
RECORD_EVENT = "checkpoint_written"
SIGNING_CONTEXT = b"proofline:ledger-checkpoint:v1\n"

Leaf = tuple[str, int, str]


# --- Merkle tree (RFC 6962 shape, domain-separated leaves and nodes) ---------------------------------


def leaf_hash(chain: str, seq: int, head: str) -> bytes:
    return hashlib.sha256(b"\x00" + canonical_bytes([chain, seq, head])).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _tree(hashes: list[bytes]) -> bytes:
    if len(hashes) == 1:
        return hashes[0]
    split = 1 << ((len(hashes) - 1).bit_length() - 1)  # the largest power of two below len
    return _node(_tree(hashes[:split]), _tree(hashes[split:]))


def merkle_root(leaves: list[Leaf]) -> str:
    if not leaves:
        return hashlib.sha256(b"").hexdigest()
    return _tree([leaf_hash(*leaf) for leaf in leaves]).hex()


def statement_hash(statement: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_bytes(statement)).hexdigest()


# --- a checkpoint as stored --------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    statement: dict[str, Any]
    signature: str
    leaves: list[Leaf]
    #: chain -> {"from": first seq, "hashes": [...]}: every event anchored since the previous checkpoint.
    hashes: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def number(self) -> int:
        return int(self.statement["number"])

    @property
    def hash(self) -> str:
        return statement_hash(self.statement)

    def heads(self) -> dict[str, tuple[int, str]]:
        return {chain: (seq, head) for chain, seq, head in self.leaves}

    def to_bytes(self) -> bytes:
        body = {"statement": self.statement, "signature": self.signature, "hash": self.hash,
                "leaves": [list(leaf) for leaf in self.leaves], "hashes": self.hashes}
        return json.dumps(body, indent=1, sort_keys=True).encode()


def sign(statement: dict[str, Any], leaves: list[Leaf], hashes: dict[str, dict[str, Any]],
         key: SigningKey) -> Checkpoint:
    signature = key.sign(SIGNING_CONTEXT + canonical_bytes(statement))
    return Checkpoint(statement, base64.b64encode(signature).decode(), leaves, hashes)


def _invalid(number: int, detail: str) -> CheckpointInvalid:
    return CheckpointInvalid(f"checkpoint {number}: {detail}", number=number)


def verify_statement(number: int, statement: Any, signature: Any, keys: dict[str, PublicKey]) -> None:
    """The statement is checkpoint ``number``, signed by a ledger key of the keyring that was valid
    (not revoked, not expired) when it signed; anything else raises CheckpointInvalid."""
    if not isinstance(statement, dict) or statement.get("format") != FORMAT or statement.get("number") != number:
        raise _invalid(number, f"not checkpoint {number} of format {FORMAT}")
    try:
        raw = base64.b64decode(str(signature), validate=True)
    except ValueError:
        raise _invalid(number, "malformed (the signature is not base64)") from None
    key = keys.get(str(statement.get("key_id")))
    if key is None:
        raise _invalid(number, f"signed with key {statement.get('key_id')!r}, not a ledger key in the keyring")
    try:
        key.public.verify(raw, SIGNING_CONTEXT + canonical_bytes(statement))
    except InvalidSignature:
        raise _invalid(number, f"signature does not verify with ledger key {key.key_id}") from None
    if key.revoked:
        raise _invalid(number, f"signed with revoked ledger key {key.key_id}")
    try:
        created = datetime.fromisoformat(str(statement.get("created_at")))
    except ValueError:
        raise _invalid(number, "created_at is not an ISO-8601 time") from None
    if created.tzinfo is None:
        raise _invalid(number, "created_at has no time zone")
    if key.not_after is not None and created > key.not_after:
        raise _invalid(number, f"signed after ledger key {key.key_id} expired ({key.not_after.isoformat()})")


def open_checkpoint(number: int, data: bytes, keys: dict[str, PublicKey]) -> Checkpoint:
    """Parse a stored checkpoint and check everything it claims; any doubt raises CheckpointInvalid."""
    try:
        body = json.loads(data)
        statement, signature = body["statement"], body["signature"]
        leaves = [(str(c), int(s), str(h)) for c, s, h in body["leaves"]]
        hashes = body["hashes"]
        assert isinstance(statement, dict) and isinstance(hashes, dict)
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise _invalid(number, f"malformed ({type(exc).__name__}: {exc})") from None
    verify_statement(number, statement, signature, keys)
    cp = Checkpoint(statement, signature, leaves, hashes)
    _check_contents(cp)
    return cp


def _check_contents(cp: Checkpoint) -> None:
    """The unsigned parts (leaf list, event hashes) must be exactly what the signed statement commits to."""
    st, n = cp.statement, cp.number
    chains = [leaf[0] for leaf in cp.leaves]
    if chains != sorted(set(chains)):
        raise _invalid(n, "leaves are not sorted and unique")
    if merkle_root(cp.leaves) != st.get("merkle_root"):
        raise _invalid(n, "the stored leaves do not match the signed Merkle root")
    if (len(cp.leaves), sum(leaf[1] for leaf in cp.leaves)) != (st.get("chains"), st.get("events")):
        raise _invalid(n, "the stored leaves do not match the signed counts")
    if hashlib.sha256(canonical_bytes(cp.hashes)).hexdigest() != st.get("hashes_digest"):
        raise _invalid(n, "the stored event hashes do not match their signed digest")
    heads = cp.heads()
    for chain, delta in cp.hashes.items():
        last = int(delta["from"]) + len(delta["hashes"]) - 1
        if heads.get(chain) != (last, delta["hashes"][-1] if delta["hashes"] else None):
            raise _invalid(n, f"the event hashes of {chain} do not end at its leaf")


# --- building the next checkpoint ----------------------------------------------------------------------

# Only events at or after each chain's previous anchor are read, and only those after it are hashed.
DELTA_SQL = """
SELECT e.action_id, e.seq, e.prev_hash, e.hash,
       CASE WHEN e.seq > COALESCE(p.seq, 0)
            THEN ledger_event_hash(e.prev_hash, e.action_id, e.seq, e.event, e.actor, e.at, e.evidence)
            ELSE e.hash END AS recomputed
FROM ledger_events e
LEFT JOIN unnest(%(chains)s::text[], %(seqs)s::int[]) AS p(action_id, seq) ON p.action_id = e.action_id
WHERE e.seq >= COALESCE(p.seq, 1)
ORDER BY e.action_id, e.seq
"""


@dataclass
class _Walk:
    """One chain read forward from its previous anchor, accepting events while they extend it."""

    seq: int
    head: str
    start: int
    hashes: list[str] = field(default_factory=list)
    seen: bool = False
    diverged: bool = False

    def take(self, row: dict[str, Any]) -> None:
        first, self.seen = not self.seen, True
        if self.diverged:
            return
        if first and self.start > 0:
            # The event the previous checkpoint anchored must still be there, unchanged.
            self.diverged = (row["seq"], row["hash"]) != (self.start, self.head)
        elif (row["seq"], row["prev_hash"], row["recomputed"]) == (self.seq + 1, self.head, row["hash"]):
            self.seq, self.head = row["seq"], row["hash"]
            self.hashes.append(row["hash"])
        else:
            self.diverged = True


def build(conn: Any, ledger: str, previous: Checkpoint | None, number: int, key: SigningKey) -> Checkpoint:
    prev_heads = previous.heads() if previous else {}
    # A chain pruned at the head it anchored is no longer carried: its head is kept by the prune record.
    gone = {c for c, p in pruned_heads(conn).items() if prev_heads.get(c) == (p.seq, p.head)}
    walks = {chain: _Walk(seq, head, seq) for chain, (seq, head) in prev_heads.items()}
    with conn.transaction(), conn.cursor(name="ledger_checkpoint") as cur:
        cur.itersize = 2000
        cur.execute(DELTA_SQL, {"chains": list(prev_heads), "seqs": [s for s, _ in prev_heads.values()]})
        for row in cur:
            walks.setdefault(row["action_id"], _Walk(0, "", 0)).take(row)
    leaves: list[Leaf] = []
    hashes: dict[str, dict[str, Any]] = {}
    diverged = []
    pruned = []
    for chain in sorted(walks):
        walk = walks[chain]
        if chain in gone and not walk.seen:
            pruned.append(chain)
            continue
        if not walk.seen or walk.diverged:
            diverged.append(chain)
        if walk.seq > 0:
            leaves.append((chain, walk.seq, walk.head))
        if walk.hashes:
            hashes[chain] = {"from": walk.start + 1, "hashes": walk.hashes}
    statement = {
        "format": FORMAT, "ledger": ledger, "number": number,
        "created_at": datetime.now(UTC).isoformat(), "key_id": key.key_id,
        "chains": len(leaves), "events": sum(leaf[1] for leaf in leaves),
        "merkle_root": merkle_root(leaves),
        "hashes_digest": hashlib.sha256(canonical_bytes(hashes)).hexdigest(),
        "prev": {"number": previous.number, "hash": previous.hash} if previous else None,
        "diverged": diverged,
        # Chains the previous checkpoint anchored and a recorded prune removed since, at that head.
        **({"pruned": pruned} if pruned else {}),
    }
    return sign(statement, leaves, hashes, key)


# --- the scheduled step ------------------------------------------------------------------------------


def ledger_name(conn: Any) -> str:
    with conn.cursor() as cur:
        cur.execute("SELECT current_database() AS name")
        return str(cur.fetchone()["name"])


@dataclass(frozen=True)
class Record:
    """A checkpoint as the ledger recorded it (its signed statement), or why the record is not one."""

    seq: int
    number: int | None
    hash: str | None
    problem: str | None = None


def recorded_checkpoints(conn: Any, keys: dict[str, PublicKey]) -> list[Record]:
    """What the ledger says was written, in order. Each record carries the checkpoint's signed
    statement, so a record the runtime role forged is told apart from a checkpoint that existed."""
    with conn.cursor() as cur:
        cur.execute("SELECT seq, evidence FROM ledger_events WHERE action_id = %s AND event = %s ORDER BY seq",
                    (RECORD_CHAIN, RECORD_EVENT))
        rows = cur.fetchall()
    records = []
    for row in rows:
        evidence = row["evidence"] if isinstance(row["evidence"], dict) else {}
        statement = evidence.get("statement")
        number = statement.get("number") if isinstance(statement, dict) else None
        try:
            if not isinstance(number, int) or number < 1:
                raise CheckpointInvalid("the record holds no checkpoint statement")
            verify_statement(number, statement, evidence.get("signature"), keys)
            records.append(Record(row["seq"], number, statement_hash(statement)))
        except CheckpointInvalid as exc:
            records.append(Record(row["seq"], None, None, f"not a genuine checkpoint record ({exc.detail})"))
    return records


def latest_valid(anchor: AnchorStore, keys: dict[str, PublicKey], ledger: str) -> Checkpoint | None:
    """The newest stored checkpoint of this ledger that verifies. A non-empty store with none that
    does is refused: starting over would anchor whatever the chains hold now."""
    numbers = anchor.list()
    for number in reversed(numbers):
        try:
            cp = open_checkpoint(number, anchor.read(number), keys)
            if cp.statement.get("ledger") != ledger:
                raise _invalid(number, f"is of ledger {cp.statement.get('ledger')!r}, not {ledger!r}")
            return cp
        except CheckpointInvalid as exc:
            log.error("skipping an invalid checkpoint", extra={"event": "checkpoint_invalid", "detail": str(exc)})
    if numbers:
        raise CheckpointInvalid(f"no checkpoint in {anchor.location} verifies; refusing to start a new series")
    return None


def write_checkpoint(conn: Any, settings: Settings, actor: str) -> dict[str, Any]:
    """Build, sign and store the next checkpoint, then record it in the ledger."""
    key = load_signing_key(settings)
    try:
        keys = load_public_keys(settings)
    except LedgerKeyUnavailable:
        keys = {}  # a checkpointer may run without the keyring; it can always check its own signatures
    own = keys.get(key.key_id)
    if own is None:
        keys[key.key_id] = PublicKey(key.key_id, KeyRole.ledger, key.public)
    elif own.public.public_bytes_raw() != key.public.public_bytes_raw():
        raise LedgerKeyUnavailable(f"the ledger key file's key {key.key_id} is not the keyring's key {key.key_id}")
    elif own.revoked:
        raise LedgerKeyUnavailable(f"ledger key {key.key_id} is revoked in the keyring; refusing to sign with it")
    ledger = ledger_name(conn)
    anchor = store_for(settings, ledger)
    previous = latest_valid(anchor, keys, ledger)
    recorded = [r.number for r in recorded_checkpoints(conn, keys) if r.number is not None]
    if previous is None and recorded:
        # The store lost every checkpoint the ledger says was written: a new series would anchor
        # whatever the chains hold now, so an operator must restore the store first.
        raise CheckpointInvalid(f"the ledger records {len(recorded)} checkpoint(s) but {anchor.location} holds "
                                "none; refusing to start a new series")
    number = max([0, *anchor.list(), *recorded]) + 1
    cp = build(conn, ledger, previous, number, key)
    anchor.append(number, cp.to_bytes())  # CheckpointExists if another writer took the number
    summary = {"number": number, "hash": cp.hash, "merkle_root": cp.statement["merkle_root"],
               "chains": cp.statement["chains"], "events": cp.statement["events"],
               "diverged": cp.statement["diverged"], "store": anchor.location}
    with store.transaction(conn) as cur:
        store.append_event_txn(cur, RECORD_CHAIN, RECORD_EVENT, actor,
                               {**summary, "statement": cp.statement, "signature": cp.signature})
    if cp.statement["diverged"]:
        log.error("chains no longer extend the previous checkpoint; their old anchors are kept",
                  extra={"event": "ledger_diverged", "chains": cp.statement["diverged"][:20]})
    return summary
