"""A backlog is not a loss: published actions whose message may still wait in its queue are not
re-driven.

The reconciler re-sends a published action that no worker started after ``redrive_after_seconds``,
on the reasoning that the broker lost its message. Behind a long backlog (a burst, or a fleet
restarting its pool processes) that reasoning is wrong: the message is still in its queue, only
late, and re-sending it adds a copy that a worker must open, check and suppress. Under a backlog
of 1,000 actions that was 1,427 suppressed duplicates in one run.

A queue is first in, first out. Every Proofline task message carries the time it was sent
(``proofline_sent_at``, stamped as it is published: ``worker/dispatch.py``), so the age of the
oldest message still waiting in a queue says what cannot be in it any more: everything sent before
that message was taken already. An action whose last send (its publication, or the reconciler's
latest re-drive of it) is older than the oldest waiting message of its queue was lost, and is
re-driven; one sent at or after it may still wait behind the backlog, and is left alone while it
is younger than ``redrive_backlog_max_seconds``. Queue depth alone cannot tell the two apart: a
queue kept busy by retries (a tenant yielding its turn) is never empty, while the lost message is
not in it.

The oldest message is read where the broker lets a reader look without taking (a Redis list's
tail). Where it does not (AMQP), the consumers say how far they have taken each queue instead: the
newest send time taken from a queue that still holds ready messages (a passive declare counts them)
is a lower bound on its oldest waiting message's (``worker/queue_marks.py``). Where the message
carries no send time, or the broker cannot be read, nothing is left alone: the sweep re-drives as it
did without this check, and the idempotency records make the extra delivery harmless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ledger import store
from proofline.shards import queue_for_tenant
from worker import queue_marks

log = logging.getLogger(__name__)

#: Queue name -> send time (epoch seconds) of the oldest message waiting in it; a queue missing
#: from the answer is empty or cannot be looked into. Raises when the broker cannot be read.
OldestWaiting = Callable[[list[str]], dict[str, float]]
#: Queue name -> ready messages in it, where only a count can be read (AMQP; ``{}`` elsewhere).
ReadyCounts = Callable[[list[str]], dict[str, int]]
#: Clocks of publishers and the database may differ a little: a send this close to the oldest
#: waiting message counts as possibly behind it.
CLOCK_MARGIN_SECONDS = 1.0

CANDIDATES_SQL = """
SELECT a.action_id, a.tenant, a.kind,
       extract(epoch FROM GREATEST(a.published_at, COALESCE((a.recovery_data->>'sent_at')::timestamptz,
                                                            a.published_at))) AS last_sent
FROM actions a
LEFT JOIN leases l ON l.action_id = a.action_id
WHERE a.next_check_at < clock_timestamp() AND ({condition})
  AND a.published_at > clock_timestamp() - make_interval(secs => %(backlog_max)s)
ORDER BY a.next_check_at LIMIT %(limit)s
"""


def queue_of(tenant: str | None, kind: str, shards: int) -> str:
    """The queue an action's execute message was put on (``worker/dispatch.py``)."""
    return "compensate" if kind != "action" else queue_for_tenant(tenant, shards)


def taken_marks_txn(cur: store.Cursor, ready: ReadyCounts, queues: list[str]) -> dict[str, float]:
    """Where a queue cannot be looked into (AMQP): for each queue that holds ready messages, the
    newest send time any consumer took from it (``worker/queue_marks.py``). First in, first out, so
    the oldest message still waiting was sent no earlier than that: it stands in for the oldest
    waiting message's send time (a lower bound, so at worst an action is left alone a little longer).
    A queue that holds nothing ready, or that no consumer took from yet, is missing."""
    depth = ready(queues)
    return queue_marks.newest_txn(cur, [q for q in queues if depth.get(q, 0) > 0])


def deferred_txn(cur: store.Cursor, oldest: OldestWaiting, condition: str, params: dict[str, Any],
                 shards: int, ready: ReadyCounts | None = None) -> list[str]:
    """The due ``not_started`` actions to leave alone this sweep: young enough, and last sent no
    earlier than the oldest message still waiting in their queue (on AMQP, given ``ready``: than the
    newest message taken from a queue that still holds some, :func:`taken_marks_txn`). Reads only;
    the claim that follows excludes them."""
    cur.execute(CANDIDATES_SQL.format(condition=condition), params)
    rows = cur.fetchall()
    if not rows:
        return []
    queues = {row["action_id"]: queue_of(row["tenant"], row["kind"], shards) for row in rows}
    names = sorted(set(queues.values()))
    try:
        waiting = oldest(names)
        unseen = [q for q in names if q not in waiting]
        if ready is not None and unseen:
            waiting.update(taken_marks_txn(cur, ready, unseen))
    except Exception as exc:  # noqa: BLE001 - an unreadable broker means "no backlog known", never a failed sweep
        log.warning("queue backlog unreadable; re-driving as if none: %s", type(exc).__name__,
                    extra={"event": "backlog_unreadable"})
        return []
    return [row["action_id"] for row in rows
            if queues[row["action_id"]] in waiting
            and float(row["last_sent"]) >= waiting[queues[row["action_id"]]] - CLOCK_MARGIN_SECONDS]
