"""What a task returns: a small summary that Flower shows as the task's result.

Celery's state (SUCCESS, RETRY, FAILURE) only says whether the task body ran; Proofline's outcome
and reason are what an operator needs, so they come first in every summary. A kill-switched action
is ``{'outcome': 'not_started', 'reason_code': 'kill_switch_engaged', ...}``, not a bare SUCCESS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TaskSummary:
    """The task's return value: small, JSON-serialisable, and what Flower shows as the task's
    result. Proofline's outcome and reason come first: Celery's SUCCESS only says the task ran."""

    status: str
    reason_code: str | None = None
    action_id: str | None = None
    outcome: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return summary(status=self.status, reason_code=self.reason_code, action_id=self.action_id,
                       outcome=self.outcome)


def summary(*, status: str, outcome: str | None = None, reason_code: str | None = None,
            action_id: str | None = None, **more: Any) -> dict[str, Any]:
    """A task result in the order Flower's result column shows it: outcome, reason, status, action."""
    ordered = {"outcome": outcome, "reason_code": reason_code, "status": status, "action_id": action_id, **more}
    return {k: v for k, v in ordered.items() if v is not None}


def with_outcome(conn: Any, result: Any) -> Any:
    """A follow-up task's result with the action's recorded outcome, reason and status, so that
    Flower shows where the action stands after the task (one indexed read)."""
    if not isinstance(result, dict) or not result.get("action_id") or "outcome" in result:
        return result
    with conn.cursor() as cur:
        cur.execute("SELECT status, outcome, reason_code FROM actions WHERE action_id = %s", (result["action_id"],))
        row = cur.fetchone()
    if row is None:
        return result
    extra = {k: v for k, v in result.items() if k not in ("status", "action_id", "reason_code", "outcome")}
    return summary(outcome=row["outcome"], reason_code=result.get("reason_code") or row["reason_code"],
                   status=row["status"], action_id=result["action_id"], task=result.get("status"), **extra)
