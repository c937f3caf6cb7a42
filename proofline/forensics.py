"""Forensic reconstruction from the ledger alone: who authorized the action, what executed, what
changed, and how the final state was determined, including every recovery action it caused.

Reads only ``ledger_events`` (and checks the chain it reads, against the head its action row
anchored), so the story it tells is the one the insert-only, hash-chained record supports. A
broken chain is reported with its first broken link, never silently told as if it were intact.
:func:`document` is the same reconstruction as data (``proofline forensics --json``).
"""

from __future__ import annotations

import json
from typing import Any

from proofline.ledger_check import check_chain
from proofline.report import ts

FINAL_EVENTS = ("final_state", "compensated", "compensation_failed", "operator_intervention", "escalated",
                "handed_to_recovery", "escalated_state")


def _events(cur: Any, chain: str) -> list[dict[str, Any]]:
    cur.execute("SELECT seq, at, event, actor, evidence FROM ledger_events WHERE action_id = %s ORDER BY seq",
                (chain,))
    return list(cur.fetchall())


#: Events that tell what was checked before execution (section 2).
CHECK_EVENTS = ("revalidated", "revalidation_failed", "lease_acquired", "idempotency_claimed",
                "idempotency_reclaimed", "reconcile_required", "preconditions_passed", "preconditions_failed",
                "duplicate_suppressed", "redelivery_ignored", "idempotency_conflict", "precheck_unavailable")
#: Events of recovery and interventions (section 5).
RECOVERY_EVENTS = ("recovery_decided", "contained", "recovery_action_published", "cancel_requested", "redriven",
                   "stale_write_refused", "run_compensation", "run_aborted", "released")


def _chain_state(cur: Any, chain: str) -> dict[str, Any]:
    count, broken = check_chain(cur, chain)
    return {"intact": broken is None, "events": count, "broken_at_seq": broken.seq if broken else None,
            "problem": broken.problem if broken else None}


def _chain_intact(cur: Any, chain: str) -> str:
    state = _chain_state(cur, chain)
    if not state["intact"]:
        return f"BROKEN at seq {state['broken_at_seq']}: {state['problem']}"
    return f"intact ({state['events']} events, hash chain verified)"


def _entry(ev: dict[str, Any]) -> dict[str, Any]:
    return {"seq": ev["seq"], "at": ev["at"].isoformat(), "event": ev["event"], "actor": ev["actor"],
            "evidence": ev["evidence"]}


def document(cur: Any, action_id: str) -> dict[str, Any] | None:
    """The reconstruction as data: the chain's own check, then the six sections, each a list of the
    ledger entries it rests on; recovery actions nest as documents of their own."""
    events = _events(cur, action_id)
    if not events:
        return None
    published = [ev for ev in events if ev["event"] in ("published", "pending")]
    recovery = []
    for ev in events:
        if ev["event"] in RECOVERY_EVENTS:
            entry = _entry(ev)
            if ev["event"] == "recovery_action_published":
                entry["action"] = document(cur, ev["evidence"]["recovery_action"])
            recovery.append(entry)
    return {
        "action_id": action_id,
        "chain": _chain_state(cur, action_id),
        "authorized": _entry(published[0]) if published else None,
        "checked": [_entry(ev) for ev in events if ev["event"] in CHECK_EVENTS],
        "executed": [_entry(ev) for ev in events if ev["event"] == "tool_called"],
        "changed": [_entry(ev) for ev in events if ev["event"] in ("verification_finished",
                                                                  "operation_record_expired")],
        "recovery": recovery,
        "final": [_entry(ev) for ev in events if ev["event"] in FINAL_EVENTS],
    }


def _j(value: Any, width: int = 160) -> str:
    text = json.dumps(value, default=str, separators=(", ", ": "))
    return text if len(text) <= width else text[: width - 1] + "…"


def reconstruct(cur: Any, action_id: str, depth: int = 0) -> str | None:
    events = _events(cur, action_id)
    if not events:
        return None
    pad = "    " * depth
    out: list[str] = []

    def line(text: str = "") -> None:
        out.append(pad + text)

    by_name: dict[str, list[dict[str, Any]]] = {}
    for ev in events:
        by_name.setdefault(ev["event"], []).append(ev)
    line(f"ACTION {action_id} - ledger chain {_chain_intact(cur, action_id)}")
    traces = list(dict.fromkeys(ev["evidence"].get("trace_id") for ev in events if ev["evidence"].get("trace_id")))
    if traces:
        line(f"   trace {', '.join(traces)} (OpenTelemetry: open it in the trace viewer)")
    published = (by_name.get("published") or by_name.get("pending") or [None])[0]
    line("1. Authorized")
    if published:
        p = published["evidence"]
        approval = p.get("approval", {})
        line(f"   at {ts(published['at'])} by {p.get('requester')} for workload "
             f"{p.get('workload_identity')} (tenant {p.get('tenant')}, {p.get('environment')})")
        line(f"   approval {approval.get('id')} v{approval.get('version')} until {approval.get('expires_at')}, "
             f"irreversible covered: {approval.get('covers_irreversible')}; policy v{p.get('policy_version')}; "
             f"signed with key {p.get('key_id')}")
        line(f"   {p.get('operation')} on {_j(p.get('target'))} via {p.get('server', {}).get('name')} "
             f"{p.get('server', {}).get('version')} / {p.get('tool', {}).get('name')}")
        line(f"   arguments {_j(p.get('arguments'))}")
        line(f"   idempotency key {p.get('idempotency_key')}; irreversible: {p.get('irreversible')}")
        if p.get("parent_action_id"):
            line(f"   a {p.get('kind')} of {p.get('parent_action_id')}")
    else:
        line("   no publication recorded (the worker recorded the action from its signed envelope)")

    line("2. Checked before execution")
    for name in CHECK_EVENTS:
        for ev in by_name.get(name, []):
            line(f"   {ts(ev['at'])} {name:<22} {ev['actor']:<22} {_j(ev['evidence'], 110)}")

    line("3. Executed")
    calls = by_name.get("tool_called", [])
    if not calls:
        line("   the tool was never called")
    for ev in calls:
        e = ev["evidence"]
        line(f"   {ts(ev['at'])} by {ev['actor']}: classified {e.get('outcome')} ({e.get('reason_code')}) "
             f"in {e.get('elapsed_ms')} ms, {e.get('progress_total')} progress notifications")
        if "result" in e:
            line(f"   result {_j(e['result'], 120)}")
        if e.get("result_digest"):
            # The values themselves are kept once, on the action row (past the size limit: not at all).
            line(f"   result sha256 {e['result_digest']} ({e.get('result_size') or e.get('result_bytes')} bytes)"
                 + (f", excerpt {_j(e['result_excerpt'], 80)}" if e.get("result_excerpt") else ""))
        if e.get("downstream_operation_id"):
            line(f"   downstream operation {e['downstream_operation_id']}")
        if e.get("error"):
            line(f"   error {_j(e['error'], 120)}")

    line("4. What changed (independent verification)")
    verifications = by_name.get("verification_finished", [])
    if not verifications:
        line("   not verified")
    for ev in verifications:
        e = ev["evidence"]
        line(f"   {ts(ev['at'])} read {e.get('read_tool')} as the {e.get('identity')} identity, "
             f"{e.get('reads')} reads ({e.get('failed_reads')} failed): finding {e.get('finding')}")
        line(f"   system of record showed {_j(e.get('after'), 130)}")
    for ev in by_name.get("operation_record_expired", []):
        line(f"   {ts(ev['at'])} the downstream operation record had expired before it was retrieved: "
             f"{_j(ev['evidence'], 100)}")

    recovery = [ev for ev in events if ev["event"] in RECOVERY_EVENTS]
    line("5. Recovery and interventions")  # always shown, so the six sections are numbered alike
    if not recovery:
        line("   none: nothing was decided or done after the call")
    for ev in recovery:
        e = ev["evidence"]
        if ev["event"] == "recovery_decided":
            line(f"   {ts(ev['at'])} decided {e['decision']} ({e['reason']}) from facts "
                 f"{_j(e['facts'], 120)}")
        else:
            line(f"   {ts(ev['at'])} {ev['event']} {_j(e, 120)}")
        if ev["event"] == "recovery_action_published":
            sub = reconstruct(cur, e["recovery_action"], depth + 1)
            if sub:
                out.append(sub)

    line("6. Final state and how it was determined")
    finals = [ev for ev in events if ev["event"] in FINAL_EVENTS]
    if not finals:
        line("   not settled yet")
    for ev in finals:
        line(f"   {ts(ev['at'])} {ev['event']} by {ev['actor']}: {_j(ev['evidence'], 130)}")
    return "\n".join(out)
