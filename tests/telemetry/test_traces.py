"""One trace per action, read back from the span files every process wrote (the controller here,
the workers' pool processes): the happy path, a lost response settled by verification, and a
compensated run. Stage spans come in the seed's order, linked parent to child across Celery tasks
and processes; the trace id is on every ledger event of the action; no span attribute holds an
argument or result value."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proofline.forensics import reconstruct
from proofline.telemetry import tracing
from proofline_kit.sor import store as sor
from tests.conftest import Stack, wait_for
from tests.helpers import (
    new_account,
    recovery_action,
    refund_env,
    run_of,
    run_settled,
    stale_close_env,
    ticket_env,
)
from tests.telemetry.conftest import Observed

Span = dict[str, Any]


@pytest.fixture(scope="module")
def traced(observed: Observed) -> Iterator[Observed]:
    """The test process is the controller: it traces its publications into the same directory."""
    saved = {k: os.environ.get(k) for k in ("OTEL_TRACES_EXPORTER", "PROOFLINE_TRACES_DIR", "OTEL_BSP_SCHEDULE_DELAY")}
    os.environ.update(OTEL_TRACES_EXPORTER="jsonl", PROOFLINE_TRACES_DIR=str(observed.traces),
                      OTEL_BSP_SCHEDULE_DELAY="200")
    try:
        assert tracing.setup("proofline-controller", "development")
        yield observed
    finally:
        tracing.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def spans(directory: Path) -> list[Span]:
    out = []
    for path in sorted(directory.glob("spans-*.jsonl")):
        out.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return out


def trace_ids(stack: Stack, action_id: str) -> set[str | None]:
    return {e["evidence"].get("trace_id") for e in stack.timeline(action_id)}


def one_trace(stack: Stack, *action_ids: str) -> str:
    """Every ledger event of these actions carries one and the same trace id."""
    ids = set().union(*(trace_ids(stack, a) for a in action_ids))
    assert len(ids) == 1 and None not in ids, ids
    return ids.pop()


def trace_spans(observed: Observed, trace_id: str, *needed: str) -> list[Span]:
    return spans_in(observed.traces, trace_id, *needed)


def spans_in(directory: Path, trace_id: str, *needed: str) -> list[Span]:
    """The spans of one trace once every parent and the ``needed`` names have been written."""
    def ready() -> list[Span]:
        # A span is written when it ends: a task's span after the spans of the tasks it published.
        mine = [s for s in spans(directory) if s["trace_id"] == trace_id]
        ids = {s["span_id"] for s in mine}
        complete = all(s["parent_id"] is None or s["parent_id"] in ids for s in mine)
        return mine if complete and set(needed) <= {s["name"] for s in mine} else []

    return sorted(wait_for(ready, 90, what=f"spans {needed} of trace {trace_id}"), key=lambda s: s["start"])


def ancestors(span: Span, by_id: dict[str, Span]) -> list[str]:
    names, parent = [], span["parent_id"]
    while parent is not None:
        names.append(by_id[parent]["name"])
        parent = by_id[parent]["parent_id"]
    return names


def check_tree(trace: list[Span], root: str) -> dict[str, Span]:
    """One root (the controller's), every other span's parent in the same trace."""
    by_id = {s["span_id"]: s for s in trace}
    roots = [s for s in trace if s["parent_id"] is None]
    assert [r["name"] for r in roots] == [root], [r["name"] for r in roots]
    assert all(s["parent_id"] in by_id for s in trace if s["parent_id"] is not None)
    assert len({s["pid"] for s in trace}) >= 2  # the controller and at least one pool process
    return by_id


def in_order(trace: list[Span], names: list[str]) -> None:
    """``names`` appear as spans in this order of start time (first occurrence of each)."""
    firsts = [next(s["start"] for s in trace if s["name"] == n) for n in names]
    assert firsts == sorted(firsts), list(zip(names, firsts, strict=True))


def values_of(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for v in value.values():
            yield from values_of(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from values_of(v)
    elif value is not None:
        yield str(value)


def no_payload(trace: list[Span], *payloads: Any) -> None:
    """No attribute (of a span or its events) holds an argument or result value; Proofline's own
    spans carry only the allowed attribute names."""
    secrets = {v for p in payloads for v in values_of(p) if len(v) >= 6}
    assert secrets
    for s in trace:
        attributes = [s["attributes"], *(e["attributes"] for e in s["events"])]
        text = json.dumps(attributes)
        assert not [v for v in secrets if v in text], (s["name"], [v for v in secrets if v in text])
        if s["name"].startswith("proofline."):
            assert set().union(*attributes) <= tracing.ALLOWED, (s["name"], s["attributes"])


EXECUTE = ["proofline.preflight", "proofline.lease", "proofline.revalidation", "proofline.precondition_read",
           "proofline.tool_call", "proofline.record_result"]
VERIFY = ["proofline.verification", "proofline.verification_read", "proofline.final_transition"]
#: Verified in place: the execute task reads, then records the result and the verdict in one commit.
IN_PLACE = ["proofline.preflight", "proofline.lease", "proofline.revalidation", "proofline.precondition_read",
            "proofline.tool_call", "proofline.verification", "proofline.verification_read", "proofline.record_result"]


def test_happy_path_is_one_trace_with_its_stages_in_order(traced: Observed) -> None:
    stack = traced.stack
    env = ticket_env(stack)
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    tid = one_trace(stack, env.action_id)
    trace = trace_spans(traced, tid, *IN_PLACE)
    by_id = check_tree(trace, "proofline.authorize_and_publish")
    in_order(trace, ["proofline.authorize_and_publish", *IN_PLACE])
    # Verified in place: the verification read is the execute task's, and no verify task ran.
    verification = next(s for s in trace if s["name"] == "proofline.verification")
    chain = ancestors(verification, by_id)
    assert "run/proofline.execute" in chain and "run/proofline.verify" not in chain
    assert not [s for s in trace if s["name"] in ("run/proofline.verify", "proofline.final_transition")]
    call = next(s for s in trace if s["name"] == "proofline.tool_call")
    assert call["attributes"]["proofline.outcome"] == "completed_unverified"
    assert call["attributes"]["proofline.action_type"] == "ticket.create"
    assert verification["attributes"]["proofline.verification_finding"] == "expected"
    no_payload(trace, env.arguments, row.result["values"])
    # Forensics names the trace.
    with stack.conn.cursor() as cur:
        assert f"trace {tid}" in reconstruct(cur, env.action_id)


def test_lost_response_is_one_trace_settled_by_verification(traced: Observed) -> None:
    stack = traced.stack
    env = refund_env(stack, new_account(stack), timeout_seconds=1.0)
    sor.set_fault(stack.sor_db, "issue_refund", "drop_response", remaining=1, delay_seconds=30)
    stack.publish(env)
    row = stack.wait_settled(env.action_id, timeout=60)
    assert row.result["recovered_by"] == "verification"
    tid = one_trace(stack, env.action_id)
    trace = trace_spans(traced, tid, *EXECUTE, *VERIFY)
    check_tree(trace, "proofline.authorize_and_publish")
    in_order(trace, ["proofline.authorize_and_publish", *EXECUTE, *VERIFY])
    call = next(s for s in trace if s["name"] == "proofline.tool_call")
    assert (call["attributes"]["proofline.outcome"], call["attributes"]["proofline.error_category"]) == (
        "unknown_outcome", "response_lost")
    no_payload(trace, env.arguments, row.result["values"])


def test_compensated_run_is_one_trace_through_recovery(traced: Observed) -> None:
    stack = traced.stack
    steps = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: stale_close_env(stack, **kw)])
    stack.publish_run(steps)
    run_settled(stack, steps[0].run_id, expect="compensated")
    compensation = recovery_action(stack, steps[0].action_id)
    wait_for(lambda: stack.action(steps[0].action_id).outcome.value == "compensated", 90, what="compensated")
    tid = one_trace(stack, steps[0].action_id, steps[1].action_id, compensation)
    trace = trace_spans(traced, tid, "proofline.recovery_decision", "proofline.compensation",
                        "run/proofline.compensate", "run/proofline.recover")
    by_id = check_tree(trace, "proofline.publish_run")
    in_order(trace, ["proofline.publish_run", "proofline.tool_call", "proofline.verification",
                     "proofline.recovery_decision", "proofline.compensation", "run/proofline.compensate"])
    # The compensation's own execution hangs under the recovery task that published it.
    run = next(s for s in trace if s["name"] == "run/proofline.compensate")
    assert "proofline.compensation" in ancestors(run, by_id)
    decision = next(s for s in trace if s["name"] == "proofline.recovery_decision")
    assert decision["attributes"]["proofline.recovery_kind"] == "compensation"
    no_payload(trace, *(e.arguments for e in steps), stack.action(compensation).envelope["arguments"])
