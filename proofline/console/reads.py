"""What the console's pages show, read from the ledger as the reader role: the action list (the
CLI's keyset listing), one action taken apart stage by stage, runs, the manual queue, kill switches
and revocations. Nothing here writes; every function takes a cursor of the reader's connection.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Any

from ledger import store
from ledger.listing import ActionFilter, list_actions, list_runs
from ledger.redact import redact
from ledger.states import ActionStatus, Outcome
from proofline.errors import ConsoleInputInvalid
from proofline.forensics import document
from recovery.runs import Step, run_outcome

#: Events that mark a stage of the execute path, and the stage they belong to (the timeline's lanes).
STAGES = {
    "published": "publish", "pending": "publish", "republished": "publish", "validated": "validate",
    "lease_acquired": "lease", "revalidated": "revalidate", "revalidation_failed": "revalidate",
    "idempotency_claimed": "claim", "idempotency_reclaimed": "claim", "duplicate_suppressed": "claim",
    "reconcile_required": "claim", "preconditions_passed": "preconditions", "preconditions_failed": "preconditions",
    "tool_called": "call", "verification_enqueued": "hand off", "retry_scheduled": "hand off",
    "verification_finished": "verify", "recovery_decided": "recovery", "recovery_action_published": "recovery",
    "contained": "recovery", "escalated": "escalation", "operator_intervention": "operator",
    "manual_retry": "operator", "cancel_requested": "operator", "final_state": "settled",
    "handed_to_recovery": "settled", "escalated_state": "settled", "authority_budget_checked": "validate",
    "plan_confirmed": "preconditions", "evidence_read": "verify", "evidence_signed": "verify",
    "operation_record_expired": "verify", "verification_superseded": "verify", "sandbox_violation": "call",
    "sandbox_audit_overflow": "call",
    "stale_write_refused": "call", "redelivery_ignored": "claim", "redelivery_reenqueued_verification": "claim",
    "oauth_token_refreshed": "call", "oauth_token_rejected": "call", "token_exchanged": "call",
}


def page_of_actions(cur: Any, flt: ActionFilter, limit: int) -> tuple[list[dict[str, Any]], str | None]:
    """One page, newest first, and the cursor of the next page (None on the last)."""
    rows = list_actions(cur, flt, limit + 1)
    page = rows[:limit]
    cursor = f"{page[-1]['published_at'].isoformat()}|{page[-1]['action_id']}" if len(rows) > limit else None
    return page, cursor


def parse_cursor(text: str | None) -> tuple[datetime, str] | None:
    """A cursor made by :func:`page_of_actions` (None: the first page); anything else is refused."""
    if not text:
        return None
    at, sep, action_id = text.partition("|")
    try:
        when = datetime.fromisoformat(at)
    except ValueError:
        when = None
    if not sep or not action_id or when is None:
        raise ConsoleInputInvalid("the page cursor is not one this console made: start from the first page")
    return when, action_id


def filter_choices(cur: Any) -> dict[str, list[str]]:
    """The values the list's filters offer: every status and outcome, the tenants and action types seen."""
    cur.execute("SELECT DISTINCT tenant FROM actions ORDER BY 1")
    tenants = [r["tenant"] for r in cur.fetchall()]
    cur.execute("SELECT DISTINCT action_type FROM actions ORDER BY 1")
    types = [r["action_type"] for r in cur.fetchall()]
    return {"status": [s.value for s in ActionStatus], "outcome": [o.value for o in Outcome], "tenant": tenants,
            "action_type": types}


def stage_timeline(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ledger event with its stage, the time since the previous event and since the first."""
    out = []
    first = previous = None
    for ev in events:
        at = ev["at"]
        first = first or at
        out.append({**ev, "stage": STAGES.get(ev["event"], "other"),
                    "since_previous_ms": None if previous is None else (at - previous).total_seconds() * 1000,
                    "since_start_ms": (at - first).total_seconds() * 1000})
        previous = at
    return out


def stage_durations(timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive events of one stage folded into a bar: the stage, when it began, how long it took
    until the next stage began (the last stage has no length)."""
    bars: list[dict[str, Any]] = []
    for ev in timeline:
        if bars and bars[-1]["stage"] == ev["stage"]:
            bars[-1]["events"].append(ev["event"])
            continue
        if bars:
            bars[-1]["ms"] = ev["since_start_ms"] - bars[-1]["start_ms"]
        bars.append({"stage": ev["stage"], "start_ms": ev["since_start_ms"], "ms": None, "events": [ev["event"]]})
    return bars


#: A run of one event longer than this shows its first row; the rest fold under a count.
RUN_SHOWN = 2
#: A timeline longer than this keeps its first and last :data:`ENDS_SHOWN` rows open; the middle folds.
LONG_TIMELINE = 40
ENDS_SHOWN = 15


#: More stage bars than this (a retried action repeats its stages once per attempt) keep the first
#: and last :data:`LANE_ENDS` open; the bars between fold under a count.
LONG_LANES = 16
LANE_ENDS = 6


def folded_lanes(bars: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The stage bars as the page draws them: ``head`` and ``tail`` open, ``middle`` folded (empty
    for a short action). Each bar keeps its place on the common time scale, folded or not."""
    if len(bars) <= LONG_LANES:
        return {"head": bars, "middle": [], "tail": []}
    return {"head": bars[:LANE_ENDS], "middle": bars[LANE_ENDS:-LANE_ENDS], "tail": bars[-LANE_ENDS:]}


def latest_open(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Events that repeat once per attempt (precondition checks, calls): the latest shown open, the
    earlier ones folded, oldest first, with how many of each outcome they had."""
    earlier = items[:-1]
    kinds = Counter(str((ev["evidence"] or {}).get("outcome") or ev["event"]) for ev in earlier)
    return {"latest": items[-1] if items else None, "earlier": earlier, "kinds": dict(kinds)}


def folded_timeline(timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timeline as the page shows it: ``{"row": ev}`` for an open row, ``{"fold": [ev, ...],
    "label": ...}`` for rows folded under a count (a long run of one event, a long middle)."""
    parts: list[dict[str, Any]] = []
    i = 0
    while i < len(timeline):
        j = i
        while j < len(timeline) and timeline[j]["event"] == timeline[i]["event"]:
            j += 1
        run = timeline[i:j]
        parts.extend({"row": ev} for ev in run[:RUN_SHOWN])
        if len(run) > RUN_SHOWN:
            rest = run[RUN_SHOWN:]
            parts.append({"fold": rest, "label": f"{len(rest)} more {run[0]['event']} events "
                                                 f"(seq {rest[0]['seq']}–{rest[-1]['seq']})"})
        i = j
    if len(parts) <= LONG_TIMELINE:
        return parts
    middle = parts[ENDS_SHOWN:-ENDS_SHOWN]
    rows = [ev for p in middle for ev in ([p["row"]] if "row" in p else p["fold"])]
    return [*parts[:ENDS_SHOWN], {"fold": rows, "label": f"{len(rows)} events in between (seq {rows[0]['seq']}–"
                                                         f"{rows[-1]['seq']})"}, *parts[-ENDS_SHOWN:]]


def last_readings(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``evidence_read`` records of the last verification that read several sources, in the
    order they were recorded (one column each on the page)."""
    groups: list[list[dict[str, Any]]] = [[]]
    for ev in events:
        if ev["event"] == "evidence_read":
            groups[-1].append(ev["evidence"] or {})
        elif ev["event"] == "verification_finished":
            groups.append([])
    return next((g for g in reversed(groups) if g), [])


def resolution(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The operator's resolution of an escalated action (who, what, when), if it was resolved by hand."""
    found = [ev for ev in events if ev["event"] == "operator_intervention" and (ev["evidence"] or {}).get("resolution")]
    if not found:
        return None
    ev = found[-1]
    return {"by": ev["actor"], "resolution": ev["evidence"]["resolution"], "at": ev["at"],
            "reason": ev["evidence"].get("reason")}


def action_detail(cur: Any, action_id: str) -> dict[str, Any] | None:
    """One action: its row, the redacted envelope, the stage timeline, and the evidence the
    forensic reconstruction sorts into sections (checked, executed, changed, recovery, final)."""
    row = store.get_action(cur, action_id)
    if row is None:
        return None
    events = store.timeline(cur, action_id)
    doc = document(cur, action_id) or {}
    timeline = stage_timeline(events)
    evidence = [ev["evidence"] or {} for ev in events]
    declared = (row.envelope.get("evidence") or {}).get("redact_fields") or []
    return {
        "row": row,
        # The stored envelope is already a redacted copy; the policy runs again for rows written
        # before redaction existed, and for whatever this page shows of the arguments.
        "envelope": redact(row.envelope, declared),
        "timeline": timeline,
        "folded": folded_timeline(timeline),
        "readings": last_readings(events),
        "resolution": resolution(events),
        "stages": folded_lanes(stage_durations(timeline)),
        "preconditions": latest_open([ev for ev in events
                                      if ev["event"] in ("preconditions_passed", "preconditions_failed")]),
        "calls": latest_open([ev for ev in events if ev["event"] == "tool_called"]),
        "verifications": [ev for ev in events if ev["event"] in ("verification_finished", "operation_record_expired")],
        "decisions": [ev for ev in events if ev["event"] == "recovery_decided"],
        "operator": [ev for ev in events if ev["event"] in ("operator_intervention", "manual_retry", "cancel_requested")],
        "final": doc.get("final", []),
        "chain": doc.get("chain") or {"intact": None, "events": 0},
        "trace_ids": list(dict.fromkeys(e["trace_id"] for e in evidence if isinstance(e.get("trace_id"), str))),
        "recovery_actions": [e.get("recovery_action") for ev, e in zip(events, evidence, strict=True)
                             if ev["event"] == "recovery_action_published"],
    }


def run_detail(cur: Any, run_id: str) -> dict[str, Any] | None:
    """A run's steps in order, the compensations its failure caused (in the order they ran, which is
    the steps' reverse), and the outcome derived from the steps."""
    rows = sorted(list_actions(cur, ActionFilter(run_id=run_id), 1000), key=lambda r: (r["step"], r["published_at"]))
    steps = [r for r in rows if r["kind"] == "action"]
    if not steps:
        return None
    derived = run_outcome([Step(r["action_id"], r["step"], ActionStatus(r["status"]),
                                Outcome(r["outcome"]) if r["outcome"] else None, r["reason_code"], None)
                           for r in steps])
    # Recovery actions carry their own run id; they point at the step they recover.
    cur.execute("SELECT action_id, parent_action_id, kind, step, status, outcome, reason_code, published_at "
                "FROM actions WHERE parent_action_id = ANY(%s) ORDER BY published_at, action_id",
                ([r["action_id"] for r in steps],))
    recoveries = list(cur.fetchall())
    cur.execute("SELECT seq, at, event, actor, evidence FROM ledger_events WHERE action_id = %s ORDER BY seq",
                (f"run:{run_id}",))
    # Steps an operator closed by hand: the derived outcome rests on their word for these.
    by_hand = [s for s in steps if (s["reason_code"] or "").startswith("operator_")]
    return {"run_id": run_id, "steps": steps, "recoveries": recoveries, "outcome": derived,
            "run_events": list(cur.fetchall()), "by_hand": by_hand}


def runs_page(cur: Any, tenant: str | None, limit: int) -> list[dict[str, Any]]:
    rows = list_runs(cur, tenant=tenant, since=None, limit=limit)
    for row in rows:
        detail = run_detail(cur, row["run_id"])
        row["outcome"] = detail["outcome"] if detail else None
    return rows


def whoami(cur: Any) -> str:
    cur.execute("SELECT current_user AS role")
    return cur.fetchone()["role"]
