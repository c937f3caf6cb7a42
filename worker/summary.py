"""What a task returns: one line that Flower shows as the task's result, and the state it shows.

Celery's state only says whether the task body returned; Proofline's outcome, the action and the
reason are what an operator needs, so the line starts with them::

    outcome=not_started action=act-7 reason=kill_switch_engaged status=closed

The stages themselves (``worker/execute.py``, ``recovery/``) return a summary dict; the task turns
it into this line (:func:`task_line`) after everything the task did is committed, and the worker's
request class (``worker/task_request.py``) sends Flower the state :func:`flower_state` names
instead of a green SUCCESS for an action that escalated, was contained, kill-switched, refused,
failed, or was left unverified.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

#: A line longer than this is cut (Celery's event repr is bounded at 1024 characters too).
MAX_LINE = 900
#: The fixed start of a line: outcome, action, reason, status; the action may be JSON-quoted.
_LINE = re.compile(r'outcome=(?P<outcome>\S+) action=(?P<action>"(?:[^"\\]|\\.)*"|\S+) '
                   r'reason=(?P<reason>\S+) status=(?P<status>\S+)(?P<rest>(?: \S+=\S+)*)$')

#: Outcomes Flower may paint green: verified, or none yet (a step waiting for the steps before it).
_FINE_OUTCOMES = frozenset({"completed_verified", "-"})
#: Outcomes of a task that handed an unproven action on (to verification, to the reconciler): the
#: next task says where it ended, and until then nothing is verified, so it is not SUCCESS either.
_UNPROVEN_OUTCOMES = {"completed_unverified": "UNVERIFIED", "unknown_outcome": "UNKNOWN_OUTCOME",
                      "accepted": "ACCEPTED"}
#: Outcomes that end an action short of what was approved, with their Flower state.
_FAILED_OUTCOMES = {"failed_before_side_effect": "ACTION_FAILED", "failed_after_side_effect": "ACTION_FAILED",
                    "partially_completed": "ACTION_FAILED", "compensation_failed": "ACTION_FAILED",
                    "compensated": "COMPENSATED"}


@dataclass
class TaskSummary:
    """A stage's summary: small, JSON-serialisable; :func:`task_line` makes it the task's result."""

    status: str
    reason_code: str | None = None
    action_id: str | None = None
    outcome: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return summary(status=self.status, reason_code=self.reason_code, action_id=self.action_id,
                       outcome=self.outcome)


def summary(*, status: str, outcome: str | None = None, reason_code: str | None = None,
            action_id: str | None = None, **more: Any) -> dict[str, Any]:
    """A stage's summary in the order the task's line shows it: outcome, action, reason, status."""
    ordered = {"outcome": outcome, "action_id": action_id, "reason_code": reason_code, "status": status, **more}
    return {k: v for k, v in ordered.items() if v is not None}


def with_outcome(conn: Any, result: Any) -> Any:
    """A follow-up task's result with the action's recorded outcome, reason, status and recovery
    kind, so that Flower shows where the action stands after the task (one indexed read)."""
    if not isinstance(result, dict) or not result.get("action_id") or "recovery" in result:
        return result
    with conn.cursor() as cur:
        cur.execute("SELECT status, outcome, reason_code, recovery_kind FROM actions WHERE action_id = %s",
                    (result["action_id"],))
        row = cur.fetchone()
    if row is None:
        return result
    extra = {k: v for k, v in result.items() if k not in ("status", "action_id", "reason_code", "outcome")}
    if result.get("status") not in (None, row["status"]):
        extra["task"] = result["status"]
    return summary(outcome=row["outcome"] or result.get("outcome"),
                   reason_code=result.get("reason_code") or row["reason_code"], status=row["status"],
                   action_id=result["action_id"], recovery=row["recovery_kind"], **extra)


def _word(value: Any) -> str:
    text = "-" if value is None or value == "" else str(value)
    return json.dumps(text) if re.search(r'[\s"=\\]', text) or not text.isprintable() else text


def task_line(result: Any) -> Any:
    """The task's return value: a stage summary as one line (anything else is returned as it is)."""
    if not isinstance(result, dict) or "status" not in result:
        return result
    head = (f"outcome={_word(result.get('outcome'))} action={_word(result.get('action_id'))} "
            f"reason={_word(result.get('reason_code'))} status={_word(result['status'])}")
    rest = [f"{k}={_word(v)}" for k, v in result.items()
            if k not in ("outcome", "action_id", "reason_code", "status") and isinstance(v, str | int | float | bool)
            and re.fullmatch(r"[a-z_]+", k)]
    line = " ".join([head, *rest])
    return line if len(line) <= MAX_LINE else head[:MAX_LINE]


def parse_line(line: str) -> dict[str, str] | None:
    """The fields of a line :func:`task_line` made (None for anything else)."""
    match = _LINE.match(line)
    if match is None:
        return None
    fields = {k: v for k, v in match.groupdict().items() if k != "rest"}
    for word in match["rest"].split():
        key, _, value = word.partition("=")
        fields.setdefault(key, value)
    return fields


def flower_state(fields: dict[str, str]) -> str:
    """The state Flower shows for a task whose line has these fields: SUCCESS only when the action
    is verified (or has no outcome yet); a custom state, which Flower draws grey, when it needs an
    operator, ended short of what was approved, or was handed on unverified (UNVERIFIED,
    UNKNOWN_OUTCOME, ACCEPTED: the next task's line says where it ended)."""
    status, outcome, reason = fields.get("status"), fields.get("outcome", "-"), fields.get("reason")
    if status == "escalated":
        return "CONTAINED" if fields.get("recovery") == "containment" else "ESCALATED"
    if "abandoned" in (status, fields.get("task")):
        return "ABANDONED"
    if "refused" in (status, fields.get("task")):
        return "REFUSED"
    if reason == "kill_switch_engaged":
        return "KILL_SWITCHED"
    if outcome == "not_started":
        return "NOT_STARTED"
    if status == "cancelled":
        return "CANCELLED"
    if outcome in _FAILED_OUTCOMES:
        return _FAILED_OUTCOMES[outcome]
    if outcome in _UNPROVEN_OUTCOMES:
        return _UNPROVEN_OUTCOMES[outcome]
    return "SUCCESS" if outcome in _FINE_OUTCOMES else outcome.upper()
