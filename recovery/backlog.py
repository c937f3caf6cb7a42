"""A backlog is not a loss: published actions still behind other messages are not re-driven.

The reconciler re-sends a published action that no worker started after ``redrive_after_seconds``,
on the reasoning that the broker lost its message. Behind a long backlog (a burst, or a fleet
restarting its pool processes) that reasoning is wrong: the message is still in its queue, only
late, and re-sending it adds a copy that a worker must open, check and suppress. Under a backlog
of 1,000 actions that was 1,427 suppressed duplicates in one run.

So before the ``not_started`` claim the sweep asks the broker how many messages wait in the queues
those actions travel on. An action whose queue still holds messages is left alone while it is
younger than ``redrive_backlog_max_seconds`` (the bound on how long a message truly lost behind a
backlog goes unnoticed); one whose queue is empty was lost, and is re-driven as before. A broker
that cannot be read defers nothing: the sweep then behaves as it did without this check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ledger import store
from proofline.shards import queue_for_tenant

log = logging.getLogger(__name__)

#: Queue name -> messages ready in it; raises when the broker cannot be read.
QueueDepths = Callable[[list[str]], dict[str, int]]

CANDIDATES_SQL = """
SELECT a.action_id, a.tenant, a.kind FROM actions a
LEFT JOIN leases l ON l.action_id = a.action_id
WHERE a.next_check_at < clock_timestamp() AND ({condition})
  AND a.published_at > clock_timestamp() - make_interval(secs => %(backlog_max)s)
ORDER BY a.next_check_at LIMIT %(limit)s
"""


def queue_of(tenant: str | None, kind: str, shards: int) -> str:
    """The queue an action's execute message was put on (``worker/dispatch.py``)."""
    return "compensate" if kind != "action" else queue_for_tenant(tenant, shards)


def deferred_txn(cur: store.Cursor, depths: QueueDepths, condition: str, params: dict[str, Any],
                 shards: int) -> list[str]:
    """The due ``not_started`` actions to leave alone this sweep: young enough, and on a queue
    that still holds messages. Reads only; the claim that follows excludes them."""
    cur.execute(CANDIDATES_SQL.format(condition=condition), params)
    rows = cur.fetchall()
    if not rows:
        return []
    queues = {row["action_id"]: queue_of(row["tenant"], row["kind"], shards) for row in rows}
    try:
        depth = depths(sorted(set(queues.values())))
    except Exception as exc:  # noqa: BLE001 - an unreadable broker means "no backlog known", never a failed sweep
        log.warning("queue depths unreadable; re-driving as if no backlog: %s", type(exc).__name__,
                    extra={"event": "backlog_depth_unreadable"})
        return []
    return [action_id for action_id, queue in queues.items() if depth.get(queue, 0) > 0]
