"""The worker-side Prometheus metrics.

Counters derived from ledger events (``proofline/telemetry/events.py``) are incremented by
:class:`LedgerEventMetrics` after the transaction that appended the events commits, so a rolled
back write is never counted. The rest are measured where they happen (latencies, CPU).

Under ``proofline worker --metrics-port`` the prefork pool processes write to
``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode, set up by
``proofline/telemetry/serve.py``) and the worker's endpoint sums them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from proofline.telemetry.events import COUNTED_EVENTS, COUNTERS, EventCounter, bounded, tenant_label

log = logging.getLogger(__name__)

PREFIX = "proofline_"

#: One counter per entry of the events table (exposed as ``proofline_<name>_total``).
EVENT_COUNTERS: dict[str, Counter] = {c.name: Counter(PREFIX + c.name, c.doc, c.label_names) for c in COUNTERS}
_BY_EVENT: dict[str, list[EventCounter]] = {}
for _c in COUNTERS:
    for _e in _c.events:
        _BY_EVENT.setdefault(_e, []).append(_c)

_LATENCY = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
VERIFICATION_SECONDS = Histogram(PREFIX + "verification_seconds", "Time verification spent reading the "
                                 "system of record, by finding", ("action_type", "finding"), buckets=_LATENCY)
PUBLISH_TO_VERIFIED_SECONDS = Histogram(PREFIX + "publish_to_verified_seconds", "From publication to a verified "
                                        "post-condition", ("action_type",), buckets=_LATENCY)
TOOL_CALL_SECONDS = Histogram(PREFIX + "tool_call_seconds", "MCP tool call duration, by classified outcome",
                              ("action_type", "outcome"), buckets=_LATENCY)
TASK_CPU_SECONDS = Counter(PREFIX + "task_cpu_seconds", "CPU seconds spent in Proofline tasks", ("task",))
TASKS = Counter(PREFIX + "tasks", "Proofline tasks run, by task", ("task",))
#: Counted in the worker's main process, which sees its pool processes die (worker/lost_delivery.py).
DELIVERIES_LOST = Counter(PREFIX + "deliveries_lost", "Deliveries whose pool process died under them, by task and "
                          "by how the message guard took the death: excused (killed from outside), counted (a "
                          "crash, an exit, an out-of-memory kill), spent (an outside kill past the message's "
                          "excuses), unrecorded (the excuse could not be written)", ("task", "taken"))
RECONCILER_SWEEPS = Counter(PREFIX + "reconciler_sweeps", "Reconciler sweeps finished")
RECONCILER_LAST_SWEEP = Gauge(PREFIX + "reconciler_last_sweep_timestamp_seconds", "When a reconciler sweep last "
                              "finished (Unix time)", multiprocess_mode="max")


class ActionInfo:
    """What the counters' labels need about an action (type, tenant, irreversible), cached per
    process (bounded)."""

    LIMIT = 20_000

    def __init__(self) -> None:
        self._known: dict[str, tuple[str, str, str]] = {}
        self._tenants: frozenset[str] | None = None

    def tenant(self, tenant: Any) -> str:
        if self._tenants is None:
            from proofline.settings import get_settings

            self._tenants = get_settings().metric_tenants
        return tenant_label(tenant, self._tenants)

    def remember(self, action_id: str, action_type: str, irreversible: Any, tenant: Any) -> None:
        if len(self._known) >= self.LIMIT:
            self._known.clear()
        self._known[action_id] = (bounded(action_type), self.tenant(tenant),
                                  "true" if str(irreversible).lower() == "true" else "false")

    def get(self, action_id: str) -> tuple[str, str, str]:
        return self._known.get(action_id, ("none", "none", "false"))

    def missing(self, action_ids: set[str]) -> list[str]:
        return sorted(a for a in action_ids if a not in self._known)


ACTIONS = ActionInfo()


class LedgerEventMetrics:
    """The ledger observer (``ledger/observe.py``) that turns committed events into counters."""

    def prepare(self, cur: Any, events: list[Any]) -> list[Any] | None:
        counted = [e for e in events if e.event in COUNTED_EVENTS]
        if not counted:
            return None
        missing = ACTIONS.missing({e.action_id for e in counted})
        if missing:
            # Labels for actions this process has not seen (re-drives, children): one read, same
            # transaction. Chains that are not actions (refusals) stay "none".
            cur.execute("SELECT action_id, action_type, tenant, envelope->>'irreversible' AS irreversible "
                        "FROM actions WHERE action_id = ANY(%s)", (missing,))
            for row in cur.fetchall():
                ACTIONS.remember(row["action_id"], row["action_type"], row["irreversible"], row["tenant"])
        return counted

    def committed(self, counted: list[Any]) -> None:
        try:
            for item in counted:
                action_type, tenant, irreversible = ACTIONS.get(item.action_id)
                for counter in _BY_EVENT[item.event]:
                    if not counter.matches(item.event, item.evidence):
                        continue
                    values = [action_type, tenant, *([irreversible] if counter.irreversible else []),
                              *(p.read(item.event, item.evidence) for p in counter.labels)]
                    EVENT_COUNTERS[counter.name].labels(*values).inc()
        except Exception:  # noqa: BLE001 - metrics never fail the write they describe
            log.warning("ledger event metrics not updated", exc_info=True, extra={"event": "metrics_error"})


def sweep_finished() -> None:
    RECONCILER_SWEEPS.inc()
    RECONCILER_LAST_SWEEP.set(time.time())
