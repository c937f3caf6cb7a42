"""Shared by the telemetry tests: a mixed batch of actions, and reading Prometheus endpoints."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from proofline.envelope import Envelope
from proofline_kit.sor import store as sor
from tests.conftest import Stack, free_port, start_process, wait_for, wait_port
from tests.helpers import (
    new_account,
    recovery_action,
    refund_env,
    run_of,
    run_settled,
    stale_close_env,
    ticket_env,
)


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of an endpoint: name -> {sorted labels: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items()))
            samples[sample.name][key] = samples[sample.name].get(key, 0.0) + sample.value
    return samples


def families(port: int) -> set[str]:
    """The metric names an endpoint exposes (with or without samples), as series names."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name, f"{family.name}_total"} if family.type == "counter" else {family.name}
    return names


def start_exporter(stack: Stack) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = start_process([sys.executable, "-m", "proofline", "exporter", "--port", str(port)], stack.env,
                         stack.workdir / "exporter.log")
    stack.processes.append(proc)
    wait_port(port)
    return proc, port


def mixed_batch(stack: Stack) -> dict[str, str]:
    """Verified, not started, duplicate, conflict, unknown outcome (lost response) and a compensated
    run, each caused for real; returns the action ids by case once all have settled."""
    happy = ticket_env(stack)
    stack.publish(happy)
    ticket = sor.put_ticket(stack.sor_db, "acme", "printer", "ops")
    reviewed = sor.get_ticket(stack.sor_db, ticket)["ticket"]["version"]
    stale = stack.envelope("ticket.close", arguments={"ticket_id": ticket, "expected_version": reviewed},
                           target={"type": "ticket", "id": ticket, "expected_version": reviewed})
    sor.bump_version(stack.sor_db, "ticket", ticket)
    stack.publish(stale)
    account = new_account(stack)
    lost = refund_env(stack, account, timeout_seconds=1.0)
    sor.set_fault(stack.sor_db, "issue_refund", "drop_response", remaining=1, delay_seconds=30)
    stack.publish(lost)
    steps = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: stale_close_env(stack, **kw)])
    stack.publish_run(steps)
    stack.wait_settled(happy.action_id)
    stack.deliver(stack.message(happy))  # a duplicate delivery
    other = refund_env(stack, account, amount=9000, action_id=lost.action_id, run_id=lost.run_id)
    stack.wait_event(lost.action_id, "tool_called")
    stack.deliver(stack.message(lost))  # the broker's retry of the lost-response action
    for action in (happy, stale, lost):
        stack.wait_settled(action.action_id, timeout=60)
    # Same action id, other arguments: a conflict.
    deliver_until_read(stack, other, "idempotency_conflict")
    run_settled(stack, steps[0].run_id, expect="compensated")
    wait_for(lambda: {"duplicate_suppressed", "redelivery_ignored"} & set(stack.events(happy.action_id)), 30,
             what="the duplicate's record")
    return {"verified": happy.action_id, "not_started": stale.action_id, "unknown": lost.action_id,
            "compensated": steps[0].action_id, "compensation": recovery_action(stack, steps[0].action_id)}


def deliver_until_read(stack: Stack, envelope: Envelope, event: str, attempts: int = 5) -> None:
    """Deliver ``envelope``'s message until its action records ``event``. A delivery that finds
    the action's lock held (the broker's retry of a settled action may still hold it) is ignored
    without being read, recorded as ``redelivery_ignored``: then it is sent again."""
    for _ in range(attempts):
        ignored = stack.events(envelope.action_id).count("redelivery_ignored")
        stack.deliver(stack.message(envelope))

        def recorded(ignored: int = ignored) -> str | None:
            events = stack.events(envelope.action_id)
            if event in events:
                return "read"
            return "ignored" if events.count("redelivery_ignored") > ignored else None

        if wait_for(recorded, 90, what=f"{event} or redelivery_ignored on {envelope.action_id}") == "read":
            return
    raise AssertionError(f"{envelope.action_id}: {attempts} deliveries ignored, no {event}")
