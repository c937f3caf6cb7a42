"""Deliveries per task message, counted in Postgres (``message_deliveries``).

The consumer counts every delivery before the pool sees it; the pool process settles the count
whenever it gets control back (a result, a retry, a recorded refusal or abandonment). A count that
keeps growing unsettled means the message ends its worker process every time (a crash, a kill, an
out-of-memory): after ``max_unsettled_deliveries`` it is moved to the ``dead_letter`` queue with a
ledger record instead of being handed to a pool process again.
"""

from __future__ import annotations

import hashlib
from typing import Any

from proofline.bounded import safe_str

DEAD_LETTER_QUEUE = "dead_letter"

COUNT_SQL = """
INSERT INTO message_deliveries AS d (message_key, task_name, action_id, deliveries, unsettled)
VALUES (%(key)s, %(task)s, %(action)s, 1, 1)
ON CONFLICT (message_key) DO UPDATE SET deliveries = d.deliveries + 1, unsettled = d.unsettled + 1,
    last_at = clock_timestamp(), action_id = COALESCE(d.action_id, EXCLUDED.action_id)
RETURNING deliveries, unsettled, last_error, dead_lettered_at
"""

SETTLE_SQL = """
UPDATE message_deliveries SET unsettled = 0, last_outcome = %(outcome)s, last_at = clock_timestamp(),
    last_error = COALESCE(%(error)s, last_error)
WHERE message_key = %(key)s
"""

ERROR_SQL = """
UPDATE message_deliveries SET last_error = %(error)s, last_at = clock_timestamp() WHERE message_key = %(key)s
"""

DEAD_SQL = """
UPDATE message_deliveries SET dead_lettered_at = clock_timestamp(), unsettled = 0, last_outcome = 'dead_lettered'
WHERE message_key = %(key)s
"""


def message_key(task_id: Any, body: bytes | str | None) -> str:
    """The task id when it is a sane one, else a digest of the body (hostile messages may lie)."""
    if isinstance(task_id, str) and 0 < len(task_id) <= 200 and task_id.isprintable():
        return "task:" + task_id
    raw = body if isinstance(body, bytes) else str(body).encode("utf-8", "surrogatepass")
    return "body:" + hashlib.sha256(raw).hexdigest()


def count(conn: Any, key: str, task_name: str, action_id: str | None) -> dict[str, Any]:
    """Count one delivery; returns the totals after it (``unsettled`` includes this one)."""
    with conn.transaction(), conn.cursor() as cur:
        cur.execute(COUNT_SQL, {"key": key, "task": safe_str(task_name, 200),
                                "action": safe_str(action_id, 200) if action_id else None})
        return dict(cur.fetchone())


def settle(conn: Any, key: str, outcome: str, error: str | None = None) -> None:
    with conn.transaction(), conn.cursor() as cur:
        cur.execute(SETTLE_SQL, {"key": key, "outcome": outcome, "error": safe_str(error, 500) if error else None})


def note_error(conn: Any, key: str, error: str) -> None:
    with conn.transaction(), conn.cursor() as cur:
        cur.execute(ERROR_SQL, {"key": key, "error": safe_str(error, 500)})


def mark_dead(conn: Any, key: str) -> None:
    with conn.transaction(), conn.cursor() as cur:
        cur.execute(DEAD_SQL, {"key": key})


def claimed_action_id(payload: Any) -> str | None:
    """The action id a decoded execute body claims (evidence only: nothing here is verified)."""
    try:
        args = payload[0]
        env = args[0].get("envelope") if args and isinstance(args[0], dict) else None
        value = env.get("action_id") if isinstance(env, dict) else None
        return value if isinstance(value, str) else None
    except Exception:  # noqa: BLE001 - any shape at all
        return None
