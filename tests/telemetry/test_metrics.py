"""Prometheus metrics against the ledger: after a mixed batch on a real stack (two supervised
workers, each with its own endpoint over a prefork pool), every event counter summed over the
workers' endpoints equals the ledger's count, by label set, as the exporter reads it from Postgres
and as a plain count of the ledger's events."""

from __future__ import annotations

import os
import re
from collections import defaultdict

from ledger.states import Outcome
from proofline.telemetry.events import COUNTERS
from tests.conftest import wait_for
from tests.helpers import ticket_env
from tests.telemetry.conftest import NAMED_TENANT, Observed
from tests.telemetry.helpers import families, mixed_batch, scrape, start_exporter
from tests.telemetry.test_alerts import alert_series
from tests.telemetry.test_dashboard import dashboard_series
from worker import faultpoints

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def counters(samples: Samples, prefix: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for counter in COUNTERS:
        out[counter.name] = {k: v for k, v in samples.get(f"{prefix}{counter.name}_total", {}).items() if v}
    return out


def summed(per_worker: list[Samples]) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    total: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(lambda: defaultdict(float))
    for samples in per_worker:
        for name, values in counters(samples, "proofline_").items():
            for key, value in values.items():
                total[name][key] += value
    return {name: dict(total[name]) for name in (c.name for c in COUNTERS)}


def test_worker_counters_equal_the_ledger_after_a_mixed_batch(observed: Observed) -> None:
    stack, ports = observed.stack, observed.ports
    _, exporter_port = start_exporter(stack)
    unnamed = f"beta-{os.getpid()}"  # a tenant the configuration does not name
    elsewhere = stack.envelope("ticket.create", tenant=unnamed, target={"type": "ticket_queue", "id": "beta-ops"},
                               arguments={"tenant": unnamed, "title": f"t-{os.getpid()}", "owner": "ops"})
    stack.publish(elsewhere)
    mixed_batch(stack)
    stack.wait_settled(elsewhere.action_id)

    def agree() -> tuple[dict, dict] | None:
        workers = summed([scrape(port) for port in ports])
        ledger = counters(scrape(exporter_port), "proofline_ledger_")
        return (workers, ledger) if workers == ledger else None

    # Follow-ups (run settlement, the compensation's parent) may still be committing: wait for
    # the two to agree, and fail with both if they never do.
    try:
        workers, ledger = wait_for(agree, 90, what="worker counters to equal the ledger's")
    except AssertionError:
        raise AssertionError(f"workers {summed([scrape(p) for p in ports])}\n"
                             f"ledger {counters(scrape(exporter_port), 'proofline_ledger_')}") from None

    def total(name: str, **labels: str) -> float:
        return sum(v for k, v in ledger[name].items() if all(dict(k).get(a) == b for a, b in labels.items()))

    # Each case of the batch left its mark (the comparison above is not between two empty sets).
    assert total("actions_started") >= 4
    assert total("precondition_failures") >= 1
    assert total("duplicates_suppressed") >= 1
    assert total("idempotency_conflicts") >= 1
    assert total("tool_calls", outcome="unknown_outcome") >= 1
    assert total("verifications", finding="expected") >= 3
    assert total("recovery_actions", kind="compensation") == 1
    assert total("compensations", result="compensated") == 1
    # Tenants: the named one by name, the unnamed one as "other", never by its own name; the
    # same on the exporter's gauges.
    assert total("actions_started", tenant=NAMED_TENANT) >= 4
    assert total("actions_started", tenant="other") == 1
    assert total("verifications", tenant="other", finding="expected") == 1
    gauges = scrape(exporter_port)
    seen = {dict(k).get("tenant") for name in ledger for k in ledger[name]}
    seen |= {dict(k)["tenant"] for name in ("proofline_ledger_actions", "proofline_ledger_awaiting_review",
                                            "proofline_ledger_unknown_outcome_open") for k in gauges[name]}
    assert unnamed not in seen and seen <= {NAMED_TENANT, "other", "none"}, seen
    assert gauges["proofline_ledger_actions"][(("action_type", "ticket.create"), ("outcome", "completed_verified"),
                                              ("status", "closed"), ("tenant", "other"))] == 1
    # Every series the alert rules read is exported by a worker or the exporter.
    exported = families(exporter_port).union(*(families(p) for p in ports))
    assert alert_series() <= exported, alert_series() - exported
    # And every series the dashboard reads (histograms by their _bucket series).
    wanted = {re.sub(r"_bucket$", "", n) for n in dashboard_series()}
    assert wanted <= exported, wanted - exported
    # And the exporter's counts are the ledger's: a plain count of the events, per counter, both read
    # again together until they agree (an event of the shared stack may land between two reads).
    def differing() -> dict[str, tuple[float, int]]:
        exported = counters(scrape(exporter_port), "proofline_ledger_")
        with stack.conn.cursor() as cur:
            cur.execute("SELECT event, count(*) AS n FROM ledger_events GROUP BY event")
            by_event = {r["event"]: r["n"] for r in cur.fetchall()}
        return {c.name: (sum(exported.get(c.name, {}).values()), sum(by_event.get(e, 0) for e in c.events))
                for c in COUNTERS if not c.when
                and sum(exported.get(c.name, {}).values()) != sum(by_event.get(e, 0) for e in c.events)}

    try:
        wait_for(lambda: not differing(), 90, interval=0.5, what="the exporter's counts to equal the ledger's")
    except AssertionError:
        raise AssertionError(f"exporter vs ledger: {differing()}") from None


def test_worker_endpoint_reports_latency_cpu_and_reconciler(observed: Observed) -> None:
    ports = observed.ports
    samples = [scrape(port) for port in ports]
    verified = sum(v for s in samples for v in s.get("proofline_verifications_total", {}).values())
    observed = sum(v for s in samples for v in s.get("proofline_verification_seconds_count", {}).values())
    assert verified >= 1 and observed == verified  # one latency observation per finished verification
    assert sum(v for s in samples for v in s.get("proofline_task_cpu_seconds_total", {}).values()) > 0
    # The first worker runs beat: its reconciler sweeps and says when it last finished one.
    wait_for(lambda: scrape(ports[0]).get("proofline_reconciler_last_sweep_timestamp_seconds"), 20,
             what="a reconciler sweep")


def test_a_pool_process_killed_from_outside_is_counted_as_an_excused_delivery(observed: Observed) -> None:
    """The worker's main process counts the deliveries its pool processes died under, by how the
    message guard took each death: a SIGKILL from outside is ``excused``, never ``counted``."""
    stack, ports = observed.stack, observed.ports

    def lost(taken: str) -> float:
        return sum(v for port in ports for labels, v in scrape(port).get("proofline_deliveries_lost_total", {}).items()
                   if dict(labels) == {"task": "proofline.execute", "taken": taken})

    before = {taken: lost(taken) for taken in ("excused", "counted")}
    env = ticket_env(stack)
    faultpoints.arm(stack.faultpoints, "on_delivery", remaining=1, action="kill", action_id=env.action_id)
    try:
        stack.publish(env)
        assert stack.wait_settled(env.action_id, timeout=60).outcome == Outcome.completed_verified
    finally:
        faultpoints.arm(stack.faultpoints, "on_delivery", remaining=0)
    assert faultpoints.fired(stack.faultpoints, "on_delivery") >= 1
    wait_for(lambda: lost("excused") == before["excused"] + 1, 30, interval=0.5, what="one excused delivery")
    assert lost("counted") == before["counted"]
