"""An action's state and ledger timeline, as data (``--json``) and as text for people.

Text never shows ``None`` (a missing value is ``-``) and every timestamp carries its date and
zone."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from ledger import store


def ts(value: datetime | None) -> str:
    """A timestamp for people: date, time to the millisecond, and the zone (always UTC)."""
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def dash(value: Any) -> str:
    """A value for a text column: ``-`` for nothing (never ``None``)."""
    if value is None or value == "":
        return "-"
    return value.value if isinstance(value, Enum) else str(value)


def action_report(cur: Any, action_id: str) -> dict[str, Any] | None:
    action = store.get_action(cur, action_id)
    if action is None:
        return None
    return {
        "action_id": action.action_id, "run_id": action.run_id, "step": action.step, "tenant": action.tenant,
        "action_type": action.action_type, "tool": action.tool, "kind": action.kind,
        "status": action.status.value, "outcome": action.outcome.value if action.outcome else None,
        "finding": action.finding, "reason_code": action.reason_code, "recovery_kind": action.recovery_kind,
        "idempotency_key": action.idempotency_key, "published_at": action.published_at,
        "updated_at": action.updated_at, "deadline": action.deadline, "result": action.result,
        "timeline": store.timeline(cur, action_id),
    }


def _short(evidence: Any, width: int = 110) -> str:
    text = json.dumps(evidence, default=str, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 1] + "…"


def event_line(ev: dict[str, Any]) -> str:
    return f"  {ev['seq']:>3} {ts(ev['at'])} {ev['event']:<28} {ev['actor'][:24]:<24} {_short(ev['evidence'], 80)}"


def render_report(report: dict[str, Any], *, timeline: bool = True) -> str:
    lines = [
        f"action    {report['action_id']}  ({report['action_type']} via {report['tool']}, tenant {report['tenant']}, "
        f"run {report['run_id']} step {report['step']})",
        f"status    {report['status']}   outcome {dash(report['outcome'])}   finding {dash(report['finding'])}   "
        f"reason {dash(report['reason_code'])}" + (f"   recovery {report['recovery_kind']}"
                                                    if report.get("recovery_kind") else ""),
        f"times     published {ts(report['published_at'])}   updated {ts(report['updated_at'])}   "
        f"deadline {ts(report['deadline'])}",
        f"key       {report['idempotency_key']}",
    ]
    if report["result"]:
        lines.append(f"result    {_short(report['result'])}")
    if timeline:
        lines.append("timeline")
        lines.extend(event_line(ev) for ev in report["timeline"])
    return "\n".join(lines)
