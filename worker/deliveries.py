"""Deliveries per task message, counted in Postgres (``message_deliveries``).

Only a delivery that ends its worker process without an outcome matters here, and such a message
always comes back *redelivered*: the broker hands out again a message that was never acknowledged
(kombu's Redis transport restores it with ``redelivered`` set, RabbitMQ flags it itself), whether
its pool process died (``reject_on_worker_lost``) or the whole worker did. So the consumer counts
redeliveries only, before the pool sees them, and a first delivery costs the database nothing:

- a redelivered message with no count yet counts two: the earlier delivery that ended its process
  unrecorded, and this one;
- the pool process settles a counted (redelivered) delivery whenever it gets control back (a
  result, a retry, a recorded refusal or abandonment);
- a count that keeps growing unsettled means the message ends its worker process every time (a
  crash, a kill, an out-of-memory): after ``max_unsettled_deliveries`` it is moved to the
  ``dead_letter`` queue with a ledger record instead of being handed to a pool process again;
- a delivery whose process was killed from outside (``worker/lost_delivery.py``: SIGKILL or
  SIGTERM with no out-of-memory kill on the node) is recorded as *excused* before the requeue and
  not counted, up to ``max_excused_deliveries`` per message.

A Celery retry is a new message under the same task id: its first delivery is not redelivered, so
an earlier count of that id that was settled undercounts the retry's first unrecorded crash by one
(the message is dead-lettered one delivery later, never not at all).
"""

from __future__ import annotations

import hashlib
from typing import Any

from proofline.bounded import safe_str

DEAD_LETTER_QUEUE = "dead_letter"

COUNT_SQL = """
INSERT INTO message_deliveries AS d (message_key, task_name, action_id, deliveries, unsettled)
VALUES (%(key)s, %(task)s, %(action)s, %(first)s, %(first)s)
ON CONFLICT (message_key) DO UPDATE SET deliveries = d.deliveries + 1, unsettled = d.unsettled + 1,
    last_at = clock_timestamp(), action_id = COALESCE(d.action_id, EXCLUDED.action_id)
RETURNING deliveries, unsettled, excused, last_error, dead_lettered_at
"""

SETTLE_SQL = """
UPDATE message_deliveries SET unsettled = 0, last_outcome = %(outcome)s, last_at = clock_timestamp(),
    last_error = COALESCE(%(error)s, last_error)
WHERE message_key = %(key)s
"""

ERROR_SQL = """
UPDATE message_deliveries SET last_error = %(error)s, last_at = clock_timestamp() WHERE message_key = %(key)s
"""

#: A delivery lost to an outside kill: recorded, not counted as unsettled. A first delivery (no row
#: yet) leaves a row of one excused delivery, so its redelivery counts one, not two.
EXCUSE_SQL = """
INSERT INTO message_deliveries AS d (message_key, task_name, action_id, deliveries, unsettled, excused, last_outcome)
VALUES (%(key)s, %(task)s, %(action)s, 1, 0, 1, 'killed_from_outside')
ON CONFLICT (message_key) DO UPDATE SET unsettled = GREATEST(d.unsettled - 1, 0), excused = d.excused + 1,
    last_outcome = 'killed_from_outside', last_at = clock_timestamp()
WHERE d.excused < %(cap)s AND d.dead_lettered_at IS NULL
RETURNING deliveries, unsettled, excused
"""

DEAD_SQL = """
UPDATE message_deliveries SET dead_lettered_at = clock_timestamp(), unsettled = 0, last_outcome = 'dead_lettered'
WHERE message_key = %(key)s
"""

#: Whether a refusal chain already holds this message's ``dead_lettered`` record.
RECORDED_SQL = """
SELECT EXISTS (SELECT 1 FROM ledger_events WHERE action_id = %(chain)s AND event = 'dead_lettered'
                 AND evidence->>'message_key' = %(key)s) AS recorded
"""


def message_key(task_id: Any, body: bytes | str | None) -> str:
    """The task id when it is a sane one, else a digest of the body (hostile messages may lie)."""
    if isinstance(task_id, str) and 0 < len(task_id) <= 200 and task_id.isprintable():
        return "task:" + task_id
    raw = body if isinstance(body, bytes) else str(body).encode("utf-8", "surrogatepass")
    return "body:" + hashlib.sha256(raw).hexdigest()


def count(conn: Any, key: str, task_name: str, action_id: str | None, *, unrecorded_before: bool = False
          ) -> dict[str, Any]:
    """Count one delivery (one autocommit statement); returns the totals after it (``unsettled``
    includes this one). ``unrecorded_before``: when the message has no count yet, an earlier
    delivery ended unrecorded (this one is a redelivery), and is counted with it."""
    with conn.cursor() as cur:
        cur.execute(COUNT_SQL, {"key": key, "task": safe_str(task_name, 200), "first": 2 if unrecorded_before else 1,
                                "action": safe_str(action_id, 200) if action_id else None})
        return dict(cur.fetchone())


def excuse(conn: Any, key: str, task_name: str, action_id: str | None, cap: int) -> dict[str, Any] | None:
    """Record one delivery of ``key`` as lost to an outside kill, so that it is not counted against
    the message; None when the message already has ``cap`` excused deliveries (or was
    dead-lettered): that death then counts like any other."""
    if cap <= 0:
        return None
    with conn.cursor() as cur:
        cur.execute(EXCUSE_SQL, {"key": key, "task": safe_str(task_name, 200), "cap": cap,
                                 "action": safe_str(action_id, 200) if action_id else None})
        row = cur.fetchone()
        return dict(row) if row else None


def settle(conn: Any, key: str, outcome: str, error: str | None = None) -> None:
    with conn.cursor() as cur:
        cur.execute(SETTLE_SQL, {"key": key, "outcome": outcome, "error": safe_str(error, 500) if error else None})


def note_error(conn: Any, key: str, error: str) -> None:
    with conn.cursor() as cur:
        cur.execute(ERROR_SQL, {"key": key, "error": safe_str(error, 500)})


def mark_dead(conn: Any, key: str) -> None:
    with conn.cursor() as cur:
        cur.execute(DEAD_SQL, {"key": key})


def dead_letter_recorded(conn: Any, chain: str, key: str) -> bool:
    """Whether ``chain`` already records message ``key`` as dead-lettered: a message requeued after
    its record is not recorded twice."""
    with conn.cursor() as cur:
        cur.execute(RECORDED_SQL, {"chain": chain, "key": key})
        return bool(cur.fetchone()["recorded"])


def redelivered(delivery_info: Any) -> bool:
    """Whether the broker flagged this delivery as a message handed out before (hostile input: only
    a literal ``True`` counts)."""
    return isinstance(delivery_info, dict) and delivery_info.get("redelivered") is True


def message_action_id(message: Any) -> str | None:
    """The action id an execute message claims (evidence only: nothing here is verified)."""
    env = message.get("envelope") if isinstance(message, dict) else None
    value = env.get("action_id") if isinstance(env, dict) else None
    return value if isinstance(value, str) else None


def claimed_action_id(payload: Any) -> str | None:
    """The action id a decoded execute body (``(args, kwargs, embed)``) claims."""
    try:
        args = payload[0]
        return message_action_id(args[0]) if args else None
    except Exception:  # noqa: BLE001 - any shape at all
        return None
