"""The overview's figures, per minute over a recent window, computed from the ledger in one read
each, and drawn as SVG by pygal (server-side: the page needs no charting script).

- verified actions per minute: ``final_state`` events whose outcome is ``completed_verified``;
- unknown-outcome rate: the share of ``tool_called`` events classified ``unknown_outcome``;
- verification-failure rate: the share of ``verification_finished`` events whose finding is neither
  ``expected`` nor ``tolerated``;
- verification latency: from an action's last ``tool_called`` to its ``verification_finished``
  (median and maximum per minute);
- queue age: how long the oldest action of each open status has waited since it last changed
  (the same query the Prometheus exporter serves as ``proofline_ledger_oldest_seconds``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pygal
from pygal.style import Style

from proofline.telemetry.ledger_metrics import OPEN_SQL, OPEN_STATUSES

#: Findings that are not a verification failure.
GOOD_FINDINGS = ("expected", "tolerated")

PER_MINUTE_SQL = """
WITH minutes AS (
  SELECT generate_series(date_trunc('minute', %(start)s::timestamptz), date_trunc('minute', %(end)s::timestamptz),
                         interval '1 minute') AS minute),
ev AS (
  SELECT date_trunc('minute', at) AS minute, event, evidence FROM ledger_events
  WHERE at >= %(start)s AND at < %(end)s
    AND event IN ('final_state', 'tool_called', 'verification_finished'))
SELECT m.minute,
  count(*) FILTER (WHERE e.event = 'final_state' AND e.evidence->>'outcome' = 'completed_verified') AS verified,
  count(*) FILTER (WHERE e.event = 'tool_called') AS calls,
  count(*) FILTER (WHERE e.event = 'tool_called' AND e.evidence->>'outcome' = 'unknown_outcome') AS unknown,
  count(*) FILTER (WHERE e.event = 'verification_finished') AS verifications,
  count(*) FILTER (WHERE e.event = 'verification_finished'
                     AND coalesce(e.evidence->>'finding', '') <> ALL(%(good)s)) AS failed
FROM minutes m LEFT JOIN ev e ON e.minute = m.minute
GROUP BY m.minute ORDER BY m.minute"""

LATENCY_SQL = """
SELECT date_trunc('minute', v.at) AS minute,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM v.at - c.at)) AS median,
       max(extract(epoch FROM v.at - c.at)) AS worst
FROM ledger_events v
JOIN LATERAL (SELECT at FROM ledger_events c WHERE c.action_id = v.action_id AND c.event = 'tool_called'
              AND c.seq < v.seq ORDER BY c.seq DESC LIMIT 1) c ON TRUE
WHERE v.event = 'verification_finished' AND v.at >= %(start)s AND v.at < %(end)s
GROUP BY 1"""


def figures(cur: Any, minutes: int = 60, now: datetime | None = None) -> dict[str, Any]:
    """Every series of the overview for the last ``minutes`` minutes (database time stamps)."""
    end = now or datetime.now(UTC)
    start = end - timedelta(minutes=minutes - 1)
    start = start.replace(second=0, microsecond=0)
    cur.execute(PER_MINUTE_SQL, {"start": start, "end": end, "good": list(GOOD_FINDINGS)})
    rows = list(cur.fetchall())
    cur.execute(LATENCY_SQL, {"start": start, "end": end})
    latency = {r["minute"]: r for r in cur.fetchall()}
    cur.execute(OPEN_SQL, {"open": list(OPEN_STATUSES)})
    ages = {r["status"]: float(r["age"]) for r in cur.fetchall()}
    cur.execute("SELECT status::text AS status, count(*) AS n FROM actions WHERE status::text = ANY(%(open)s) "
                "GROUP BY 1", {"open": list(OPEN_STATUSES)})
    waiting = {r["status"]: int(r["n"]) for r in cur.fetchall()}
    return {
        "minutes": [r["minute"] for r in rows],
        "verified": [int(r["verified"]) for r in rows],
        "unknown_rate": [_share(r["unknown"], r["calls"]) for r in rows],
        "failure_rate": [_share(r["failed"], r["verifications"]) for r in rows],
        "latency_median": [_seconds(latency.get(r["minute"]), "median") for r in rows],
        "latency_worst": [_seconds(latency.get(r["minute"]), "worst") for r in rows],
        "queue_age": {s: ages.get(s, 0.0) for s in OPEN_STATUSES},
        "waiting": {s: waiting.get(s, 0) for s in OPEN_STATUSES},
        "totals": {"verified": sum(int(r["verified"]) for r in rows), "calls": sum(int(r["calls"]) for r in rows),
                   "unknown": sum(int(r["unknown"]) for r in rows),
                   "verifications": sum(int(r["verifications"]) for r in rows),
                   "failed": sum(int(r["failed"]) for r in rows)},
    }


def _share(part: int, whole: int) -> float | None:
    return None if not whole else 100.0 * part / whole


def _seconds(row: dict[str, Any] | None, key: str) -> float | None:
    return None if row is None or row[key] is None else round(float(row[key]), 3)


STYLE = Style(background="white", plot_background="white", foreground="#333", foreground_strong="#111",
              foreground_subtle="#999", colors=("#2b6cb0", "#c05621", "#2f855a", "#b83280"),
              font_family="system-ui, sans-serif")


#: Minutes between labelled ticks: the smallest that leaves at most :data:`MAX_TICKS` on the axis.
TICK_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 180, 240, 360)
MAX_TICKS = 7


def time_axis(minutes: list[datetime]) -> tuple[list[str], list[str]]:
    """Every minute's label (UTC, ``HH:MM``; the day too when the window crosses midnight) and the
    handful of them that are drawn: whole multiples of a step that leaves at most seven ticks."""
    if not minutes:
        return [], []
    dated = minutes[0].date() != minutes[-1].date()
    labels = [m.strftime("%d %b %H:%M" if dated else "%H:%M") for m in minutes]
    step = next((s for s in TICK_STEPS if len(minutes) / s <= MAX_TICKS), TICK_STEPS[-1])
    major = [label for m, label in zip(minutes, labels, strict=True) if (m.hour * 60 + m.minute) % step == 0]
    return labels, major or labels[:1]


def _chart(kind: type, title: str, **options: Any) -> Any:
    # js=[]: pygal's default embeds a script from the network; the console serves nothing external.
    # truncate_label=-1: pygal otherwise cuts every label to the width of one minute's slot ("…").
    return kind(title=title, style=STYLE, js=[], width=640, height=260, show_legend=True, legend_at_bottom=True,
                x_label_rotation=0, show_minor_x_labels=False, truncate_label=-1, truncate_legend=-1,
                disable_xml_declaration=True, print_values=False, **options)


def charts(data: dict[str, Any]) -> dict[str, str]:
    """Inline SVG documents, one per figure."""
    labels, major = time_axis(data["minutes"])
    axis = {"x_labels_major": major, "x_title": "minute (UTC)"}
    out = {}
    verified = _chart(pygal.Bar, "Verified actions per minute", **axis)
    verified.x_labels = labels
    verified.add("completed_verified", data["verified"])
    out["verified"] = verified.render(is_unicode=True)
    rates = _chart(pygal.Line, "Unknown outcomes and verification failures (% per minute)", **axis,
                   range=(0, 100), allow_interruptions=True, show_dots=True, dots_size=2)
    rates.x_labels = labels
    rates.add("unknown outcome / calls", data["unknown_rate"])
    rates.add("failed verification / verifications", data["failure_rate"])
    out["rates"] = rates.render(is_unicode=True)
    latency = _chart(pygal.Line, "Verification latency, call to verdict (s)", **axis,
                     allow_interruptions=True, show_dots=True, dots_size=2)
    latency.x_labels = labels
    latency.add("median", data["latency_median"])
    latency.add("slowest", data["latency_worst"])
    out["latency"] = latency.render(is_unicode=True)
    age = _chart(pygal.HorizontalBar, "Queue age: oldest action in each open status (s)")
    for status, seconds in data["queue_age"].items():
        age.add(f"{status} ({data['waiting'][status]} waiting)", [round(seconds, 1)])
    out["queue_age"] = age.render(is_unicode=True)
    return out
