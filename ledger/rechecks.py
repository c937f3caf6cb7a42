"""Guarded SQL of the post-condition re-checks (``postcondition_checks``, migration 0017).

A row's life: ``scheduled`` (written with the verdict that closed its action verified) ->
``claimed`` (the reconciler's sweep took it once due, and sent it to a worker) -> ``held``,
``regressed`` or ``unreadable`` (the worker read it); ``claimed`` again when its claim expired
before a worker finished it (the worker died); ``cancelled`` when the action regressed at an
earlier re-check or left its verified state; ``expired`` when its horizon passed unread. Every move
is one ``UPDATE ... WHERE status IN (...)``; a finish also names the claim's attempt, the fencing
token, so a worker whose claim was taken again cannot write over the newer one.

Each function runs in the caller's transaction; the events that explain the moves are the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledger.states import RecheckStatus
from ledger.store import Cursor
from proofline.errors import TransitionRefused
from proofline.recheck import Recheck

#: Open rows: waiting, or sent to a worker that has not finished yet.
OPEN = (RecheckStatus.scheduled.value, RecheckStatus.claimed.value)
#: What a worker's reading may end a claimed re-check as.
FINISHED = frozenset({RecheckStatus.held, RecheckStatus.regressed, RecheckStatus.unreadable,
                      RecheckStatus.cancelled})

SCHEDULE_SQL = """
INSERT INTO postcondition_checks (action_id, seq, recheck_key, offset_ms, due_at, horizon_at)
SELECT %(action_id)s, s.seq, %(key)s || ':recheck:' || s.seq, s.ms,
       clock_timestamp() + make_interval(secs => s.ms / 1000.0),
       clock_timestamp() + make_interval(secs => %(horizon)s)
  FROM unnest(%(offsets)s::bigint[]) WITH ORDINALITY AS s(ms, seq)
ON CONFLICT DO NOTHING
"""

# Rows due (or whose claim expired) inside their horizon, oldest first, taken with SKIP LOCKED so
# that two sweepers never take one row; the claim and its expiry are set in the same statement.
# The bounds are the statement's time (stable), not clock_timestamp() (volatile): only a stable
# bound lets the planner read postcondition_checks_open_idx instead of every row.
CLAIM_SQL = """
WITH due AS (
    SELECT c.id FROM postcondition_checks c
     WHERE c.status IN ('scheduled', 'claimed') AND c.due_at <= statement_timestamp()
       AND c.horizon_at > statement_timestamp()
       AND (c.status = 'scheduled' OR c.claim_expires_at < statement_timestamp())
     ORDER BY c.due_at LIMIT %(limit)s
     FOR UPDATE SKIP LOCKED
)
UPDATE postcondition_checks c SET status = 'claimed', attempts = c.attempts + 1,
       claim_expires_at = clock_timestamp() + make_interval(secs => %(claim)s)
  FROM due, actions a
 WHERE c.id = due.id AND a.action_id = c.action_id
RETURNING c.id, c.action_id, c.seq, c.recheck_key, c.attempts, c.offset_ms, a.tenant
"""

# Rows whose horizon passed before anyone read them (an open claim is left to its worker until it expires).
EXPIRE_SQL = """
WITH gone AS (
    SELECT c.id FROM postcondition_checks c
     WHERE c.status IN ('scheduled', 'claimed') AND c.due_at <= statement_timestamp()
       AND c.horizon_at <= statement_timestamp()
       AND (c.status = 'scheduled' OR c.claim_expires_at < statement_timestamp())
     LIMIT %(limit)s
     FOR UPDATE SKIP LOCKED
)
UPDATE postcondition_checks c SET status = 'expired', finished_at = clock_timestamp()
  FROM gone WHERE c.id = gone.id
RETURNING c.id, c.action_id, c.seq, c.recheck_key, c.attempts
"""


@dataclass(frozen=True)
class Check:
    """One re-check as a worker reads it."""

    id: int
    action_id: str
    seq: int
    recheck_key: str
    offset_ms: int
    status: RecheckStatus
    attempts: int
    #: How many re-checks its action has in all (the last one ends the chain).
    of: int

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Check:
        return cls(row["id"], row["action_id"], row["seq"], row["recheck_key"], row["offset_ms"],
                   RecheckStatus(row["status"]), row["attempts"], row["of"])


def plan(recheck: Recheck) -> dict[str, Any]:
    """What ``recheck_scheduled`` records: the offsets and the horizon, in seconds."""
    return {"at_seconds": list(recheck.at), "horizon_seconds": recheck.horizon_seconds, "checks": len(recheck.at)}


def schedule_txn(cur: Cursor, action_id: str, idempotency_key: str, recheck: Recheck) -> None:
    """Write the action's re-checks, due at each offset from now (the verdict's transaction). Fetches
    nothing, so it runs inside a pipelined transaction too."""
    cur.execute(SCHEDULE_SQL, {"action_id": action_id, "key": idempotency_key, "horizon": recheck.horizon_seconds,
                               "offsets": [round(offset * 1000) for offset in recheck.at]})


def claim_due_txn(cur: Cursor, limit: int, claim_seconds: float) -> list[dict[str, Any]]:
    """Claim the re-checks due now (and those whose claim expired); an idle call writes nothing."""
    cur.execute(CLAIM_SQL, {"limit": limit, "claim": claim_seconds})
    return [dict(r) for r in cur.fetchall()]


def expire_txn(cur: Cursor, limit: int) -> list[dict[str, Any]]:
    """Mark ``expired`` the open re-checks whose horizon passed unread."""
    cur.execute(EXPIRE_SQL, {"limit": limit})
    return [dict(r) for r in cur.fetchall()]


def get_txn(cur: Cursor, check_id: int, *, lock: bool = False) -> Check | None:
    cur.execute("SELECT c.*, (SELECT count(*) FROM postcondition_checks o WHERE o.action_id = c.action_id) AS of "
                "FROM postcondition_checks c WHERE c.id = %s" + (" FOR UPDATE OF c" if lock else ""), (check_id,))
    row = cur.fetchone()
    return Check.from_row(row) if row else None


def finish_txn(cur: Cursor, check_id: int, attempt: int, status: RecheckStatus, finding: str | None) -> None:
    """End a claimed re-check as ``status``; only the claim's own attempt may. Raises
    :class:`TransitionRefused` when the row is not claimed under that attempt any more."""
    if status not in FINISHED:
        raise ValueError(f"a re-check does not finish as {status.value}")
    cur.execute("UPDATE postcondition_checks SET status = %s, finding = %s, finished_at = clock_timestamp(), "
                "claim_expires_at = NULL WHERE id = %s AND status = 'claimed' AND attempts = %s RETURNING id",
                (status.value, finding, check_id, attempt))
    if cur.fetchone() is None:
        raise TransitionRefused(f"re-check {check_id} is not claimed under attempt {attempt}", check_id=check_id)


def cancel_open_txn(cur: Cursor, action_id: str) -> list[int]:
    """Cancel the action's open re-checks (it regressed, or left its verified state); their seqs."""
    cur.execute("UPDATE postcondition_checks SET status = 'cancelled', finished_at = clock_timestamp(), "
                "claim_expires_at = NULL WHERE action_id = %s AND status IN ('scheduled', 'claimed') RETURNING seq",
                (action_id,))
    return sorted(r["seq"] for r in cur.fetchall())


def open_count_txn(cur: Cursor, action_id: str) -> int:
    cur.execute("SELECT count(*) AS n FROM postcondition_checks WHERE action_id = %s AND status IN "
                "('scheduled', 'claimed')", (action_id,))
    row = cur.fetchone()
    return int(row["n"]) if row else 0
