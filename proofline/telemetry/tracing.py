"""OpenTelemetry traces: one trace per action, from the controller's publication through the
execute, verify, recover and compensation tasks (context carried in Celery's message headers by
opentelemetry-instrumentation-celery) to the MCP request (``traceparent`` in ``_meta``).

Configured with the standard variables: ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, or
``jsonl`` for span files in ``PROOFLINE_TRACES_DIR``), ``OTEL_EXPORTER_OTLP_*``,
``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER``/``_ARG``, ``OTEL_SDK_DISABLED``. Tracing is on only
when ``OTEL_TRACES_EXPORTER`` names an exporter; off, :func:`span` is a shared null context and
nothing is imported, so it costs nothing.

Span attributes are the seed's low-cardinality set only (:data:`ALLOWED`); anything else passed
to :func:`span` is dropped, so no argument, result, prompt or secret can reach a span.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

#: The attributes a Proofline span may carry (the seed's list), with the span names of its stages.
ALLOWED = frozenset({
    "proofline.agent", "proofline.workflow", "proofline.action_type", "proofline.tool", "proofline.server",
    "proofline.server_version", "deployment.environment", "proofline.outcome", "proofline.recovery_kind",
    "proofline.error_category", "proofline.verification_finding", "proofline.stage", "proofline.attempt",
})
_NULL = nullcontext()
_state: dict[str, Any] = {"enabled": False, "provider": None, "tracer": None, "instrumentors": []}
#: The client libraries instrumented when tracing is on (names as ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``
#: spells them): a span per statement (its text, never its parameters) and per HTTP request to a
#: tool server (the MCP SDK's client is httpx2; the request carries ``traceparent`` as a header
#: too). Each is a child of the stage it ran in.
CLIENTS = ("psycopg", "httpx")
#: Which of :data:`CLIENTS` to instrument (comma-separated, or ``all``); none by default: a span per
#: statement and per request doubled tracing's CPU in the worker (measured with
#: ``ops/telemetry_bench.py``: worker CPU with tracing on 1.11x off without them, 1.38x with them),
#: and the stage spans already time each statement flight and MCP request.
CLIENTS_ENV = "PROOFLINE_TRACE_CLIENTS"


def traced_clients() -> tuple[str, ...]:
    """The client libraries :data:`CLIENTS_ENV` asks for, less those
    ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` names."""
    asked = {n.strip() for n in os.environ.get(CLIENTS_ENV, "").split(",") if n.strip()}
    disabled = {n.strip() for n in os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "").split(",")}
    return tuple(n for n in CLIENTS if ("all" in asked or n in asked) and n not in disabled)


def configured() -> list[str]:
    """The exporters ``OTEL_TRACES_EXPORTER`` names (none when unset, ``none`` or SDK disabled)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return []
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    return [] if names in ([], ["none"]) else names


def enabled() -> bool:
    return _state["enabled"]


def setup(service_name: str, environment: str, release: str | None = None, *, celery: bool = True) -> bool:
    """Start tracing in this process when configured (idempotent); instrument Celery publishing and
    task runs, and the client libraries :func:`traced_clients` names (Postgres statements, HTTP
    requests; none unless asked for). Returns whether tracing is on."""
    names = configured()
    if not names or _state["enabled"]:
        return _state["enabled"]
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name,
                                "service.version": release_name(release), "deployment.environment": environment})
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    for name in names:
        provider.add_span_processor(_processor(name))
    # Proofline's spans and the instrumentations use this provider directly; it is not made the
    # global one, so libraries tracing on their own (the MCP SDK's "MCP send <method>" spans, one
    # per request, each a repeat of the stage span it sits in) record nothing: a sixth of an
    # action's spans, for no information the stages and HTTP spans do not carry.
    _state.update(enabled=True, provider=provider, tracer=provider.get_tracer("proofline"))
    from proofline.telemetry import observe  # the app level: the ledger records the trace id on every event

    observe.install_annotator(_ids)
    disabled = {n.strip() for n in os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "").split(",")}
    for name in (*(("celery",) if celery else ()), *traced_clients()):
        if name not in disabled:
            instrumentor = _instrumentor(name)
            instrumentor.instrument(tracer_provider=provider)
            _state["instrumentors"].append(instrumentor)
    return True


def _instrumentor(name: str) -> Any:
    if name == "celery":
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        return CeleryInstrumentor()
    if name == "psycopg":
        from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor

        # Statement text only: capture_parameters and the SQL commenter stay off (their defaults).
        return PsycopgInstrumentor()
    from opentelemetry.instrumentation.httpx import HTTPX2ClientInstrumentor

    # The request's method, URL (credentials redacted) and status; no header or body is captured
    # unless OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_* names one.
    return HTTPX2ClientInstrumentor()


def _processor(name: str) -> Any:
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return BatchSpanProcessor(OTLPSpanExporter())
    if name == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter())
    if name == "jsonl":
        from proofline.telemetry.span_files import JsonLinesSpanExporter

        # Batched like OTLP (OTEL_BSP_* apply): the task never waits for the file.
        return BatchSpanProcessor(JsonLinesSpanExporter(os.environ.get("PROOFLINE_TRACES_DIR") or "var/traces"))
    raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (otlp, console, jsonl, none)")


def shutdown() -> None:
    """Flush and stop (a process that exits, or a test that is done)."""
    from proofline.telemetry import observe

    observe.install_annotator(None)
    for instrumentor in _state["instrumentors"]:
        instrumentor.uninstrument()
    if _state["provider"] is not None:
        _state["provider"].shutdown()
    _state.update(enabled=False, provider=None, tracer=None, instrumentors=[])


def flush() -> None:
    """Export every finished span now (a controller about to exit or wait)."""
    if _state["provider"] is not None:
        _state["provider"].force_flush()


def release_name(configured: str | None) -> str:
    """The release telemetry reports: the configured one, else ``proofline@<package version>``."""
    if configured:
        return configured
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"proofline@{version('proofline')}"
    except PackageNotFoundError:
        return "proofline@unknown"


def span(name: str, **attributes: Any) -> Any:
    """A child span of the current one for one stage (a shared null context when tracing is off).
    Only :data:`ALLOWED` attributes with short string, bool or int values are kept."""
    if not _state["enabled"]:
        return _NULL
    return _span(name, attributes)


@contextmanager
def _span(name: str, attributes: dict[str, Any]) -> Iterator[Any]:
    with _state["tracer"].start_as_current_span(name, attributes=clean(attributes)) as current:
        yield current


def started(name: str, **attributes: Any) -> Any:
    """A span started but not current (None when tracing is off): make it current with
    :func:`current` as often as needed, then :func:`end` it."""
    return _state["tracer"].start_span(name, attributes=clean(attributes)) if _state["enabled"] else None


def current(started_span: Any) -> Any:
    """A context in which ``started_span`` is the current span (without ending it on exit)."""
    if started_span is None or not _state["enabled"]:
        return _NULL
    from opentelemetry import trace

    return trace.use_span(started_span, end_on_exit=False)


def end(started_span: Any) -> None:
    if started_span is not None:
        started_span.end()


def about(envelope: Any) -> dict[str, Any]:
    """The low-cardinality attributes of an action, from its envelope (never its arguments)."""
    return {"proofline.action_type": envelope.action_type, "proofline.tool": envelope.tool.name,
            "proofline.server": envelope.server.name, "proofline.server_version": envelope.server.version,
            "proofline.workflow": envelope.workflow_type, "proofline.agent": envelope.workload_identity,
            "deployment.environment": envelope.environment}


def clean(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, bool | int) else str(v)[:80]) for k, v in attributes.items()
            if k in ALLOWED and v is not None}


def mark(name: str, **attributes: Any) -> None:
    """A span with no duration of its own: a decision taken at this point (nothing when off)."""
    if _state["enabled"]:
        with _span(name, attributes):
            pass


def annotate(current: Any, **attributes: Any) -> None:
    """Set allowed attributes on a span :func:`span` returned (nothing when tracing is off)."""
    if current is not None and _state["enabled"]:
        current.set_attributes(clean(attributes))


def _ids() -> dict[str, str] | None:
    """The trace and span ids of the current span, as ledger evidence records them."""
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")} if ctx.is_valid \
        else None


def resume(ids: dict[str, Any] | None, name: str, **attributes: Any) -> Any:
    """A span continuing an action's trace from the ids its ledger events recorded (a re-drive by
    the reconciler joins the action's trace, linked to the sweep that did it); a plain child span
    when there are none."""
    if not _state["enabled"]:
        return _NULL
    try:
        tid, sid = int(str((ids or {})["trace_id"]), 16), int(str((ids or {})["span_id"]), 16)
    except (KeyError, ValueError):
        return _span(name, attributes)
    return _resumed(tid, sid, name, attributes)


@contextmanager
def _resumed(tid: int, sid: int, name: str, attributes: dict[str, Any]) -> Iterator[Any]:
    from opentelemetry import trace

    parent = trace.SpanContext(tid, sid, is_remote=True, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    sweep = trace.get_current_span().get_span_context()
    with _state["tracer"].start_as_current_span(
            name, context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
            links=[trace.Link(sweep)] if sweep.is_valid else None, attributes=clean(attributes)) as current:
        yield current


def trace_id() -> str | None:
    """The current trace id (32 hex digits) while tracing is on and a span is active."""
    if not _state["enabled"]:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def carrier() -> dict[str, str]:
    """The W3C trace context of the current span (``traceparent``), for an MCP request's ``_meta``."""
    if not _state["enabled"]:
        return {}
    from opentelemetry.propagate import inject

    headers: dict[str, str] = {}
    inject(headers)
    return {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}


class Stages:
    """A task's stages as consecutive sibling spans under the task's span: entering one ends the
    one before. While a stage is open it is the current span (the MCP request's ``traceparent``
    names it). Costs one flag test per call when tracing is off."""

    def __init__(self) -> None:
        self.attributes: dict[str, Any] = {}
        self._span: Any = None
        self._token: Any = None

    def describe(self, **attributes: Any) -> None:
        """Attributes every later stage span carries (action type, tool, environment...)."""
        if _state["enabled"]:
            self.attributes.update(clean(attributes))

    def enter(self, name: str, **attributes: Any) -> None:
        if not _state["enabled"]:
            return
        self.close()
        from opentelemetry import context, trace

        self._span = _state["tracer"].start_span(
            name, attributes={**self.attributes, **clean(attributes), "proofline.stage": name.rsplit(".", 1)[-1]})
        self._token = context.attach(trace.set_span_in_context(self._span))

    def note(self, **attributes: Any) -> None:
        """Attributes of the open stage (its outcome, finding, error category)."""
        if self._span is not None:
            self._span.set_attributes(clean(attributes))

    def event(self, name: str, **attributes: Any) -> None:
        if self._span is not None:
            self._span.add_event(name, clean(attributes))

    def close(self, **attributes: Any) -> None:
        if self._span is None:
            return
        from opentelemetry import context

        self._span.set_attributes(clean(attributes))
        self._span.end()
        context.detach(self._token)
        self._span = self._token = None
