"""The reconciler's heartbeat: every sweep that commits stamps its process's row, so an operator
(and ``proofline doctor``) can tell that lost messages are being re-driven at all."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb

BEAT_SQL = """
INSERT INTO reconciler_heartbeats (sweeper, swept_at, counts) VALUES (%s, clock_timestamp(), %s)
ON CONFLICT (sweeper) DO UPDATE SET swept_at = EXCLUDED.swept_at, counts = EXCLUDED.counts
"""

LATEST_SQL = """
SELECT sweeper, swept_at, counts, EXTRACT(EPOCH FROM clock_timestamp() - swept_at)::float AS age_seconds
FROM reconciler_heartbeats ORDER BY swept_at DESC LIMIT 1
"""


@dataclass(frozen=True)
class Heartbeat:
    sweeper: str
    swept_at: datetime
    #: What the sweep found, by kind (the reconciler's own counts).
    counts: dict[str, int]
    #: How long ago, by the database's clock.
    age_seconds: float


def beat_txn(cur: Any, sweeper: str, counts: dict[str, int]) -> None:
    """Record that ``sweeper`` swept now (in the sweep's own transaction: it commits with it)."""
    cur.execute(BEAT_SQL, (sweeper, Jsonb(counts)))


def latest(cur: Any) -> Heartbeat | None:
    """The most recent sweep of any process, or None if no reconciler ever swept this database."""
    cur.execute(LATEST_SQL)
    row = cur.fetchone()
    return Heartbeat(**row) if row else None
