"""Pure logic of the telemetry modules (no services): label bounding, the span attribute
allow-list, and tracing switched off."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from proofline.settings import ROOT, Settings
from proofline.telemetry import tracing
from proofline.telemetry.events import COUNTERS, Path, bounded, tenant_label


def test_label_values_are_short_identifiers_or_other() -> None:
    assert bounded("response_lost") == "response_lost"
    assert bounded("tool_error:Some Server's Own Class") == "tool_error"  # the server's text never becomes a label
    assert bounded("x" * 49) == "other" and bounded("two words") == "other"
    assert (bounded(None), bounded(""), bounded(True), bounded(3)) == ("none", "none", "true", "3")
    assert Path("reason", ("failures", 0, "reason")).read("e", {"failures": [{"reason": "stale_version"}]}) == \
        "stale_version"
    assert Path("reason", ("failures", 0, "reason")).read("e", {"failures": []}) == "none"


def test_tenant_label_names_only_configured_tenants() -> None:
    named = Settings(telemetry_tenants="acme, globex,,").metric_tenants
    assert named == {"acme", "globex"}
    assert [tenant_label(t, named) for t in ("acme", "globex", "initech", "", None)] == \
        ["acme", "globex", "other", "other", "none"]
    # A configured name that is not a short identifier is still not a label value.
    assert tenant_label("a b", frozenset({"a b"})) == "other"
    with pytest.raises(ValidationError, match="more than 100"):
        Settings(telemetry_tenants=",".join(f"t{i}" for i in range(101)))


def test_every_counter_has_unique_name_and_label_names() -> None:
    names = [c.name for c in COUNTERS]
    assert len(names) == len(set(names))
    for counter in COUNTERS:
        assert len(counter.label_names) == len(set(counter.label_names)), counter.name


def test_span_attributes_outside_the_allow_list_are_dropped() -> None:
    kept = tracing.clean({"proofline.action_type": "refund.issue", "arguments": {"amount": 5}, "result": "secret",
                          "proofline.tool": "x" * 200, "proofline.outcome": None})
    assert kept == {"proofline.action_type": "refund.issue", "proofline.tool": "x" * 80}


def test_tracing_off_is_a_shared_null_context() -> None:
    assert not tracing.enabled()
    assert isinstance(tracing.span("proofline.tool_call", **{"proofline.tool": "t"}), contextlib.nullcontext)
    assert tracing.span("a") is tracing.span("b")
    assert tracing.carrier() == {} and tracing.trace_id() is None
    stages = tracing.Stages()
    stages.enter("proofline.preflight")
    stages.close()  # nothing was started, nothing to end


def test_tracing_off_loads_no_tracer_and_instruments_nothing() -> None:
    """Off means no cost: in a fresh process with no OTEL_* set, importing the worker's tasks and
    the SDK and asking for tracing starts no tracer provider and wraps no client library."""
    probe = ("import sys, psycopg, httpx2, worker.tasks, proofline.client\n"
             "from proofline.telemetry import tracing\n"
             "assert not tracing.setup('proofline-worker', 'development')\n"
             "loaded = sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace', "
             "'opentelemetry.instrumentation')))\n"
             "wrapped = [f for f in (psycopg.connect, httpx2.AsyncHTTPTransport.handle_async_request) "
             "if hasattr(f, '__wrapped__')]\n"
             "print(loaded, wrapped)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] []", done.stdout


def test_client_libraries_are_traced_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from proofline.telemetry import tracing

    monkeypatch.delenv("PROOFLINE_TRACE_CLIENTS", raising=False)
    monkeypatch.delenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", raising=False)
    assert tracing.traced_clients() == ()
    monkeypatch.setenv("PROOFLINE_TRACE_CLIENTS", "httpx")
    assert tracing.traced_clients() == ("httpx",)
    monkeypatch.setenv("PROOFLINE_TRACE_CLIENTS", "all")
    assert tracing.traced_clients() == ("psycopg", "httpx")
    monkeypatch.setenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "psycopg")
    assert tracing.traced_clients() == ("httpx",)
