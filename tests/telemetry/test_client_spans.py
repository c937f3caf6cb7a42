"""Traces that start at the controller (``proofline publish`` and the SDK's ``Client``) and reach
into the client libraries: on a stack whose tool server speaks streamable HTTP, an action's trace
holds the controller's span as its root, the workers' stages under it, a span per Postgres
statement (its text, never its parameters) and a span per HTTP request to the tool server, each
under the stage that made it, and no argument value anywhere."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from proofline.client import Client
from proofline.settings import ROOT
from proofline.telemetry import tracing
from proofline_kit import zygote
from tests.conftest import Stack, build_stack, start_workers, teardown_stack
from tests.helpers import ticket_env
from tests.telemetry.test_traces import Span, ancestors, check_tree, no_payload, one_trace, spans_in

TRACING = {"OTEL_TRACES_EXPORTER": "jsonl", "OTEL_BSP_SCHEDULE_DELAY": "200", "PROOFLINE_TRACE_CLIENTS": "psycopg,httpx"}


@pytest.fixture(scope="module")
def http_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    stack = build_stack("http", tmp_path_factory.mktemp("client-spans"))
    traces = stack.workdir / "traces"
    try:
        start_workers(stack, name="c", beat=False, env={**stack.env, **TRACING, "PROOFLINE_TRACES_DIR": str(traces)})
        yield stack, traces
    finally:
        teardown_stack(stack)


def cli_publish(stack: Stack, traces: Path, action_id: str, arguments: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "OTEL_"))}
    env.update({k: v for k, v in stack.env.items() if k.startswith(("PROOFLINE_", "SOR_"))})
    env.update(TRACING, PROOFLINE_TRACES_DIR=str(traces), PYTHONPATH=str(ROOT))
    done = zygote.run([sys.executable, "-m", "proofline", "publish", "--action-type", "ticket.create",
                           "--tenant", "acme", "--target", json.dumps({"type": "ticket_queue", "id": "acme-ops"}),
                           "--args", json.dumps(arguments), "--run-id", f"run-{action_id}", "--action-id", action_id],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def check_clients(trace: list[Span]) -> None:
    """Statements and HTTP requests are spans of the client libraries, each under a Proofline stage."""
    by_id = {s["span_id"]: s for s in trace}
    statements = [s for s in trace if s["attributes"].get("db.system") == "postgresql"
                  or s["attributes"].get("db.system.name") == "postgresql"]
    requests = [s for s in trace if "http.request.method" in s["attributes"] or "http.method" in s["attributes"]]
    assert statements and requests, sorted({s["name"] for s in trace})
    for statement in statements:
        text = statement["attributes"].get("db.statement") or statement["attributes"].get("db.query.text")
        assert text, statement  # the statement's text; its parameters are not recorded (no_payload checks)
        assert any(n.startswith(("proofline.", "run/proofline.")) for n in ancestors(statement, by_id)), statement
    # The worker's statements hang under its stages (the lease, the record of the result...).
    worker_stages = {p for s in statements for p in ancestors(s, by_id)[:1]}
    assert {"proofline.lease", "proofline.record_result"} <= worker_stages, worker_stages
    # Each request directly under the stage that asked (revalidation's discovery, the call,
    # verification's reads); the tool call's among them.
    for request in requests:
        chain = ancestors(request, by_id)
        assert chain[0].startswith("proofline."), chain
    assert any("proofline.tool_call" in ancestors(r, by_id) for r in requests)


#: A trace is complete when the execute task that verified in place has recorded the result and verdict.
SETTLED_IN_PLACE = ("proofline.tool_call", "proofline.verification_read", "proofline.record_result")


def test_cli_publish_roots_the_trace_with_db_and_http_spans(http_stack: tuple[Stack, Path]) -> None:
    stack, traces = http_stack
    action_id = f"cli-{uuid.uuid4().hex[:10]}"
    arguments = {"tenant": "acme", "title": f"traced {uuid.uuid4().hex}", "owner": "ops"}
    cli_publish(stack, traces, action_id, arguments)
    row = stack.wait_settled(action_id)
    trace = spans_in(traces, one_trace(stack, action_id), *SETTLED_IN_PLACE)
    check_tree(trace, "proofline.authorize_and_publish")
    root = next(s for s in trace if s["parent_id"] is None)
    assert root["service"] == "proofline-controller"
    # The CLI's own statements (the publication's insert) are under its span.
    assert any(s["service"] == "proofline-controller" and s["parent_id"] == root["span_id"]
               and "db.statement" in s["attributes"] for s in trace)
    check_clients(trace)
    no_payload(trace, arguments, row.result["values"])


def test_sdk_client_roots_each_action_trace(http_stack: tuple[Stack, Path]) -> None:
    stack, traces = http_stack
    saved = {k: os.environ.get(k) for k in (*TRACING, "PROOFLINE_TRACES_DIR")}
    os.environ.update(TRACING, PROOFLINE_TRACES_DIR=str(traces))
    try:
        with Client(stack.settings, app=stack.app, database_url=stack.urls["controller"]) as client:
            one, two = ticket_env(stack), ticket_env(stack)
            handles = client.publish_many([one, two])
            results = [h.wait(timeout=60) for h in handles]
    finally:
        tracing.shutdown()
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    assert all(r.verified for r in results)
    ids = [one_trace(stack, e.action_id) for e in (one, two)]
    assert ids[0] != ids[1]  # a batch is one trace per action
    for envelope, tid in zip((one, two), ids, strict=True):
        trace = spans_in(traces, tid, *SETTLED_IN_PLACE)
        check_tree(trace, "proofline.authorize_and_publish")
        check_clients(trace)
        no_payload(trace, envelope.arguments, stack.action(envelope.action_id).result["values"])
