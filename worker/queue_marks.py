"""How far each consumer has taken each queue: the newest send time it took, kept in Postgres.

A Proofline task message carries the time it was sent (``proofline_sent_at``,
``worker/dispatch.py``). A queue is first in, first out, so once a consumer has taken a message sent
at *t*, every message sent to that queue before *t* has been taken already. On a broker that cannot
be looked into without taking a message (AMQP), that is what lets the reconciler tell an action whose
message still waits behind a backlog from one whose message was lost (``recovery/backlog.py``).

The worker's main process notes the newest send time per queue as its consumer admits messages and
writes the marks at most once per :data:`FLUSH_SECONDS` (one upsert for every queue that moved),
raising each row only (``GREATEST``). A mark that could not be written is kept for the next flush;
a mark that lags only makes the reconciler wait longer before it re-sends. The broker's content is
not trusted: a send time that is not a finite number near now is ignored.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

log = logging.getLogger(__name__)

#: At most one write of the marks per this many seconds, per consumer.
FLUSH_SECONDS = 1.0
#: A send time further than this from the consumer's clock is not believed (a hostile or broken header).
PLAUSIBLE_SKEW_SECONDS = 24 * 3600.0

UPSERT_SQL = """
INSERT INTO queue_marks AS m (queue, consumer, sent_at)
SELECT q, %(consumer)s, s FROM unnest(%(queues)s::text[], %(sent)s::float8[]) AS t(q, s)
ON CONFLICT (queue, consumer) DO UPDATE SET sent_at = GREATEST(m.sent_at, EXCLUDED.sent_at),
    updated_at = clock_timestamp()
"""

#: The newest send time any consumer took from each of the queues.
NEWEST_SQL = "SELECT queue, max(sent_at) AS sent_at FROM queue_marks WHERE queue = ANY(%(queues)s) GROUP BY queue"


def plausible(value: Any, now: float) -> float | None:
    """The send time in a message header, if it is a finite number within a day of ``now``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) and abs(value - now) <= PLAUSIBLE_SKEW_SECONDS else None


def write(conn: Any, consumer: str, marks: dict[str, float]) -> None:
    """Raise ``consumer``'s marks to ``marks`` (queue -> send time), in one statement."""
    if not marks:
        return
    queues = sorted(marks)
    with conn.cursor() as cur:
        cur.execute(UPSERT_SQL, {"consumer": consumer, "queues": queues, "sent": [marks[q] for q in queues]})


def newest_txn(cur: Any, queues: list[str]) -> dict[str, float]:
    """The newest send time taken from each queue by any consumer (queues nobody took from are missing)."""
    if not queues:
        return {}
    cur.execute(NEWEST_SQL, {"queues": queues})
    return {row["queue"]: float(row["sent_at"]) for row in cur.fetchall()}


class Marks:
    """The consumer's side: note what it admits, write the marks that moved now and then."""

    def __init__(self, consumer: str, run: Any, flush_seconds: float = FLUSH_SECONDS,
                 clock: Any = time.time) -> None:
        #: ``run(fn, *args)`` calls ``fn(conn, *args)`` on the consumer's own connection (worker/guard.py).
        self.consumer, self.run, self.flush_seconds, self.clock = consumer, run, flush_seconds, clock
        self._newest: dict[str, float] = {}
        self._unwritten: dict[str, float] = {}
        self._written_at = 0.0

    def taken(self, queue: Any, sent_at: Any) -> None:
        """A message sent at ``sent_at`` was taken from ``queue``; write the marks if one is due."""
        now = self.clock()
        sent = plausible(sent_at, now)
        if sent is not None and isinstance(queue, str) and 0 < len(queue) <= 200 \
                and sent > self._newest.get(queue, -math.inf):
            self._newest[queue] = sent
            self._unwritten[queue] = sent
        if self._unwritten and now - self._written_at >= self.flush_seconds:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        pending, self._unwritten = self._unwritten, {}
        self._written_at = self.clock() if now is None else now
        try:
            self.run(write, self.consumer, pending)
        except Exception as exc:  # noqa: BLE001 - a mark is a hint: kept for the next flush, never a failed delivery
            for queue, sent in pending.items():
                self._unwritten[queue] = max(sent, self._unwritten.get(queue, -math.inf))
            log.warning("queue marks not written", extra={"event": "queue_marks_unwritten",
                                                          "error": type(exc).__name__})
