"""The ledger-event counters: which events each counter counts and how its labels are read.

One table, read two ways: a worker counts an event when the transaction that appended it commits
(``proofline/telemetry/metrics.py``), and the exporter counts the same events in Postgres with the
SQL each label and condition gives (``proofline/telemetry/ledger_metrics.py``). So the two agree
whenever every write went through an observed worker since it started.

Labels are low-cardinality by construction: a value is kept only if it is a short identifier
(``reason:detail`` keeps the part before the colon), anything else becomes ``other``; a tenant is
named only if the configuration names it (``PROOFLINE_TELEMETRY_TENANTS``), else ``other``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_IDENT = re.compile(r"^[A-Za-z0-9_.\-]{1,48}$")


def bounded(value: Any) -> str:
    """A label value: a short identifier, ``none`` for nothing, ``other`` for anything else."""
    if value is None or value == "":
        return "none"
    text = str(value).split(":", 1)[0] if isinstance(value, str) else str(value).lower()
    return text if _IDENT.match(text) else "other"


def tenant_label(tenant: Any, named: frozenset[str]) -> str:
    """A tenant's label value: its name if ``PROOFLINE_TELEMETRY_TENANTS`` names it (and it is a
    short identifier), ``none`` when there is no action (refusals of messages that named none),
    ``other`` for every other tenant, so the label stays bounded by configuration."""
    if tenant is None:
        return "none"
    return tenant if tenant in named and _IDENT.match(str(tenant)) else "other"


def tenant_sql(column: str) -> str:
    """The SQL form of :func:`tenant_label` (the named tenants are the ``%(tenants)s`` parameter)."""
    return (f"CASE WHEN {column} IS NULL THEN 'none' WHEN {column} = ANY(%(tenants)s) "
            f"AND {column} ~ '^[A-Za-z0-9_.\\-]{{1,48}}$' THEN {column} ELSE 'other' END")


def _at(value: Any, path: tuple[str | int, ...]) -> Any:
    for step in path:
        if isinstance(step, int):
            value = value[step] if isinstance(value, list) and len(value) > step else None
        else:
            value = value.get(step) if isinstance(value, dict) else None
    return value


@dataclass(frozen=True)
class Path:
    """A label read from the evidence at a JSON path (``@event`` is the event's own name)."""

    name: str
    path: tuple[str | int, ...]

    def read(self, event: str, evidence: dict[str, Any]) -> str:
        if self.path == ("@event",):
            return event
        return bounded(_at(evidence, self.path))

    def sql(self) -> str:
        if self.path == ("@event",):
            return "e.event"
        return bounded_sql(f"split_part(e.evidence #>> '{{{','.join(str(p) for p in self.path)}}}', ':', 1)")


def bounded_sql(raw: str) -> str:
    """The SQL form of :func:`bounded` for a text expression."""
    return (f"CASE WHEN {raw} IS NULL OR {raw} = '' THEN 'none' "
            f"WHEN {raw} ~ '^[A-Za-z0-9_.\\-]{{1,48}}$' THEN {raw} ELSE 'other' END")


@dataclass(frozen=True)
class OneOf:
    """A condition: the evidence value at ``path`` is one of ``values``."""

    path: tuple[str, ...]
    values: tuple[str, ...]

    def holds(self, evidence: dict[str, Any]) -> bool:
        return _at(evidence, self.path) in self.values

    def sql(self) -> str:
        quoted = ", ".join(f"'{v}'" for v in self.values)
        return f"(e.evidence #>> '{{{','.join(self.path)}}}') IN ({quoted})"


@dataclass(frozen=True)
class Mentions:
    """A condition: the error recorded at ``path`` (its type or message) mentions one of ``words``."""

    path: tuple[str, ...]
    words: tuple[str, ...]

    def holds(self, evidence: dict[str, Any]) -> bool:
        value = _at(evidence, self.path)
        if not isinstance(value, dict):
            return False
        text = f"{value.get('type', '')} {value.get('message', '')}".lower()
        return any(word in text for word in self.words)

    def sql(self) -> str:
        base = ",".join(self.path)
        text = (f"lower(coalesce(e.evidence #>> '{{{base},type}}', '') || ' ' || "
                f"coalesce(e.evidence #>> '{{{base},message}}', ''))")
        return "(" + " OR ".join(f"position('{w}' in {text}) > 0" for w in self.words) + ")"


@dataclass(frozen=True)
class EventCounter:
    """``proofline_<name>_total``: the events named, labelled by action type and tenant (``none``
    for chains that are not actions) and ``labels``, counted when every condition in ``when`` holds."""

    name: str
    doc: str
    events: tuple[str, ...]
    labels: tuple[Path, ...] = ()
    when: tuple[OneOf | Mentions, ...] = ()
    #: Also labelled by whether the action is irreversible.
    irreversible: bool = False

    @property
    def label_names(self) -> tuple[str, ...]:
        return ("action_type", "tenant", *(["irreversible"] if self.irreversible else []), *(p.name for p in self.labels))

    def matches(self, event: str, evidence: dict[str, Any]) -> bool:
        return event in self.events and all(c.holds(evidence) for c in self.when)


REASON = Path("reason", ("reason_code",))

#: Every counter derived from ledger events, in the seed's order where the seed names one.
COUNTERS: tuple[EventCounter, ...] = (
    EventCounter("actions_started", "Authorized actions that claimed their idempotency key and began",
                 ("idempotency_claimed",), irreversible=True),
    EventCounter("precondition_failures", "Precondition checks that failed before a call",
                 ("preconditions_failed",), (Path("reason", ("failures", 0, "reason")),)),
    EventCounter("revalidation_failures", "Actions refused at runtime revalidation (approval, identity, "
                 "kill switch, contract)", ("revalidation_failed",), (REASON,)),
    EventCounter("duplicates_suppressed", "Duplicate deliveries that did not call again",
                 ("duplicate_suppressed", "redelivery_ignored"), (Path("how", ("@event",)),)),
    EventCounter("idempotency_conflicts", "Idempotency keys reused with other arguments or contract",
                 ("idempotency_conflict",)),
    EventCounter("lease_conflicts", "Deliveries that found the target's lease held", ("target_busy",)),
    EventCounter("tool_calls", "MCP tool calls, by classified outcome and reason",
                 ("tool_called",), (Path("outcome", ("outcome",)), REASON)),
    EventCounter("timeouts", "Tool calls whose response path ended in a timeout", ("tool_called",),
                 when=(Mentions(("error",), ("timeout", "timed out")),)),
    EventCounter("verifications", "Verifications finished, by finding", ("verification_finished",),
                 (Path("finding", ("finding",)),)),
    EventCounter("postcondition_regressions", "Verified actions whose post-condition no longer held at a later "
                 "re-check (the contract's verification.recheck), by what the re-read found",
                 ("postcondition_regressed",), (Path("finding", ("read_finding",)),)),
    EventCounter("retries", "Deliveries retried with the same key, by the classified cause",
                 ("retry_scheduled",), (Path("cause", ("cause",)),)),
    EventCounter("recovery_decisions", "Recovery decisions, by kind and reason", ("recovery_decided",),
                 (Path("decision", ("decision",)), Path("reason", ("reason",)))),
    EventCounter("recovery_actions", "Recovery actions published (compensation attempts and others)",
                 ("recovery_action_published",), (Path("kind", ("kind",)),)),
    EventCounter("compensations", "Compensations settled, by result", ("compensated", "compensation_failed"),
                 (Path("result", ("@event",)),)),
    EventCounter("manual_recoveries", "Actions handed to an operator", ("escalated",), (REASON,)),
    EventCounter("containments", "Kill switches set by recovery for a tool and tenant", ("contained",)),
    EventCounter("sandbox_violations", "Sandbox limits that ended a tool server during a call",
                 ("sandbox_violation",)),
    EventCounter("sandbox_audit_overflows", "Sandbox audits that lost or left unread lines of a server's "
                 "denied syscalls, by why", ("sandbox_audit_overflow",), (Path("reason", ("reason",)),)),
    EventCounter("refusals", "Messages, publications and re-drives refused, by reason",
                 ("envelope_refused", "publish_refused", "redrive_refused", "recovery_refused"),
                 (Path("event", ("@event",)), REASON)),
    EventCounter("reconciler_redrives", "Actions the reconciler re-drove, by why (lease_expired: a lease "
                 "ran out under a worker)", ("redriven",), (Path("reason", ("reason",)),)),
    EventCounter("proposals", "Actions prepared and left waiting for an approver, by authority mode (an "
                 "autonomous action outside its bounds is proposed too)", ("proposed",), (Path("mode", ("mode",)),)),
    EventCounter("simulations", "Actions simulated: plan prepared and recorded, nothing committed", ("simulated",)),
    EventCounter("authority_demotions", "Action types demoted automatically after a regression, by the rung "
                 "they were sent to", ("authority_demoted",), (Path("to", ("to",)),)),
    EventCounter("proposal_decisions", "Proposals approved or denied by approvers", ("approval_recorded",
                 "proposal_denied"), (Path("decision", ("@event",)),)),
    EventCounter("final_states", "Actions reaching a final state through verification or cancellation",
                 ("final_state",), (Path("status", ("status",)), Path("outcome", ("outcome",)))),
)

#: Every event name some counter counts.
COUNTED_EVENTS = frozenset(e for c in COUNTERS for e in c.events)
