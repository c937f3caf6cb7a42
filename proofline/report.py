"""Reconstruct an action from the ledger alone: who authorized it, what executed, what changed,
and how its final state was determined."""

from __future__ import annotations

import json
from typing import Any

from ledger import store


def action_report(cur: Any, action_id: str) -> dict[str, Any] | None:
    action = store.get_action(cur, action_id)
    if action is None:
        return None
    return {
        "action_id": action.action_id, "run_id": action.run_id, "tenant": action.tenant,
        "action_type": action.action_type, "tool": action.tool, "status": action.status.value,
        "outcome": action.outcome.value if action.outcome else None, "finding": action.finding,
        "reason_code": action.reason_code, "idempotency_key": action.idempotency_key,
        "result": action.result, "timeline": store.timeline(cur, action_id),
    }


def _short(evidence: dict[str, Any], width: int = 110) -> str:
    text = json.dumps(evidence, default=str, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 1] + "…"


def render_report(report: dict[str, Any], *, timeline: bool = True) -> str:
    lines = [
        f"action   {report['action_id']}  ({report['action_type']} via {report['tool']}, tenant {report['tenant']})",
        f"status   {report['status']}   outcome {report['outcome']}   finding {report['finding']}   "
        f"reason {report['reason_code']}",
        f"key      {report['idempotency_key']}",
    ]
    if report["result"]:
        lines.append(f"result   {_short(report['result'])}")
    if timeline:
        lines.append("timeline")
        for ev in report["timeline"]:
            lines.append(f"  {ev['seq']:>3} {ev['at']:%H:%M:%S.%f} {ev['event']:<28} {ev['actor'][:24]:<24} "
                         f"{_short(ev['evidence'], 80)}")
    return "\n".join(lines)
