"""Logs and Sentry under the redaction policy (ledger/redact.py).

- A logging filter on every handler of the worker's loggers: the message (arguments merged in),
  the formatted exception and string extras are scrubbed by the policy and by the secret values of
  the action the current task handles (``current_redactor``).
- Sentry: no local variables, no default PII, the deployment's environment, and a ``before_send``
  that replaces Celery task arguments with a digest and scrubs the whole event the same way.
- Remote inspection (``celery inspect active|reserved|scheduled``, Flower's worker pages): the
  worker answers with the tasks' ``argsrepr`` (action id and digest), never their arguments.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker import control
from celery.worker import state as worker_state

from ledger.redact import Redactor, current_redactor
from proofline.settings import Settings, reveal
from worker.dispatch import task_repr

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def _redactor() -> Redactor:
    return current_redactor.get()


class ScrubFilter(logging.Filter):
    """Rewrites a record in place before any handler formats it; never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        red = _redactor()
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string must still be logged, scrubbed
            message = f"{record.msg!r} % {record.args!r}"
        record.msg, record.args = red.text(message), None
        if record.exc_info and record.exc_info[0] is not None:
            # Formatters use a set exc_text as is; exc_info stays for Sentry's logging integration
            # (which reads the record after the handlers; its events go through scrub_event).
            record.exc_text = red.text(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = red.text(record.exc_text)
        for name, value in list(vars(record).items()):
            if name not in _STANDARD and not name.startswith("_"):
                setattr(record, name, red(value) if not red.is_sensitive(name) else "[redacted]")
        return True


_FILTER = ScrubFilter()


def install_log_scrubbing(*loggers: logging.Logger) -> None:
    """Attach the filter to every handler of the root logger (where Celery's and ours end up) and
    of the given loggers (Celery's task logger does not propagate)."""
    for logger in (logging.getLogger(), *loggers):
        for handler in logger.handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)


def _scrub_frames(event: dict[str, Any]) -> None:
    for exc in (event.get("exception") or {}).get("values") or []:
        for frame in (exc.get("stacktrace") or {}).get("frames") or []:
            frame.pop("vars", None)
    for thread in (event.get("threads") or {}).get("values") or []:
        for frame in (thread.get("stacktrace") or {}).get("frames") or []:
            frame.pop("vars", None)


def scrub_event(event: dict[str, Any], hint: dict[str, Any] | None = None) -> dict[str, Any]:
    """Sentry ``before_send``: no frame variables, task arguments as a digest, everything else
    through the policy and the current action's redactor."""
    _scrub_frames(event)
    extra = event.get("extra")
    job = extra.get("celery-job") if isinstance(extra, dict) else None
    if isinstance(job, dict) and isinstance(job.get("args"), list | tuple):
        # Only when the SDK was configured to include them (it filters them without PII).
        job["args"], job["kwargs"] = task_repr(job["args"], job.get("kwargs") or None)
    event.pop("request", None)
    return _redactor()(event)


def scrub_breadcrumb(crumb: dict[str, Any], hint: dict[str, Any] | None = None) -> dict[str, Any]:
    return _redactor()(crumb)


def init_sentry(settings: Settings, **options: Any) -> bool:
    """Initialise Sentry when a DSN is configured; returns whether it was. Every process type
    calls it (workers and beat through worker/tasks.py, the CLI and the exporter at start): the
    Celery integration reports task failures, and with ``sentry_traces_sample_rate`` that share of
    tasks as transactions (scrubbed like events)."""
    if not settings.sentry_dsn:
        return False
    import sentry_sdk
    from sentry_sdk.integrations.celery import CeleryIntegration

    from proofline.telemetry.tracing import release_name

    tracing = bool(settings.sentry_traces_sample_rate)
    sentry_sdk.init(
        dsn=reveal(settings.sentry_dsn), environment=settings.environment, release=release_name(settings.release),
        # Stack locals held the signing keys, database URLs and argument values.
        include_local_variables=False, send_default_pii=False, max_request_body_size="never",
        before_send=scrub_event, before_send_transaction=scrub_event, before_breadcrumb=scrub_breadcrumb,
        traces_sample_rate=settings.sentry_traces_sample_rate if tracing else None,
        # Beat's schedule is not a Sentry cron monitor; task headers carry Sentry's trace only
        # when Sentry traces (OpenTelemetry carries Proofline's own).
        integrations=[CeleryIntegration(monitor_beat_tasks=False, propagate_traces=tracing)],
        # Tool servers are untrusted: no trace headers (release, environment, key) on calls to them.
        trace_propagation_targets=[], **options,
    )
    return True


# Celery's own inspect commands return a task's raw arguments (the whole envelope) for reserved and
# scheduled tasks, and for active ones unless asked for ``safe``. Registered under the same names,
# these replace them in this worker: every answer uses the argsrepr set at publish time.


@control.inspect_command(alias="dump_active")
def active(state: Any, safe: bool = True, **_: Any) -> list[dict[str, Any]]:
    """Tasks being executed (arguments shown as their argsrepr only)."""
    return [request.info(safe=True) for request in state.tset(worker_state.active_requests)]


@control.inspect_command(alias="dump_reserved")
def reserved(state: Any, **_: Any) -> list[dict[str, Any]]:
    """Reserved tasks, not including scheduled or active ones (argsrepr only)."""
    tasks = state.tset(worker_state.reserved_requests) - state.tset(worker_state.active_requests)
    return [request.info(safe=True) for request in tasks]


@control.inspect_command(alias="dump_schedule")
def scheduled(state: Any, **_: Any) -> list[dict[str, Any]]:
    """Tasks waiting for their countdown (argsrepr only)."""
    out = []
    for waiting in state.consumer.timer.schedule.queue:
        args = getattr(waiting.entry, "args", None) or ()
        request = args[0] if args else None
        if hasattr(request, "info") and hasattr(request, "eta"):
            out.append({"eta": request.eta.isoformat() if request.eta else None, "priority": waiting.priority,
                        "request": request.info(safe=True)})
    return out
