"""Structured log lines: every record a worker writes while it handles an action carries the
action id, run id, tenant, stage and trace id, and the ``extra=`` fields (``event``,
``reason_code``...) that Celery's own format drops.

Two formats (``PROOFLINE_LOG_FORMAT``): ``text`` (Celery's layout with ``key=value`` fields
appended) and ``json`` (one object per line). Installed on the handlers Celery sets up, after the
scrubbing filter (``worker/observability.py``), so what is written is what the filter left.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from celery import current_task as _current_task

from proofline.telemetry import context, tracing

#: The fields that name the action a line is about, in the order they are written.
ACTION_FIELDS = ("action_id", "run_id", "tenant", "stage", "trace_id")
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "color"}
TEXT_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"


def current_task() -> Any:
    """The Celery task this process is running, if any (None outside a task)."""
    task = _current_task._get_current_object()
    return task if task is not None and getattr(task.request, "id", None) else None


class ActionFields(logging.Filter):
    """Adds the current action's fields to a record (an ``extra=`` value set by the caller wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = context.current()
        if ctx is not None:
            for name in ("action_id", "run_id", "tenant", "stage"):
                if getattr(record, name, None) is None:
                    setattr(record, name, getattr(ctx, name))
        task = current_task()
        if task is not None and getattr(record, "task_id", None) is None:
            record.task, record.task_id = task.name, task.request.id
        if getattr(record, "trace_id", None) is None:
            trace_id = tracing.trace_id()  # one flag test when tracing is off
            if trace_id is not None:
                record.trace_id = trace_id
        return True


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = {name: getattr(record, name) for name in ACTION_FIELDS if getattr(record, name, None) is not None}
    for name, value in vars(record).items():
        if name not in _STANDARD and name not in fields and not name.startswith("_") and value is not None:
            fields[name] = value
    return fields


class TextFormatter(logging.Formatter):
    """Celery's layout, then the action's fields and the extras as ``key=value``."""

    def __init__(self, fmt: str = TEXT_FORMAT) -> None:
        super().__init__(fmt)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        if not fields:
            return line
        text = " ".join(f"{k}={v if isinstance(v, str) and v and ' ' not in v else json.dumps(v, default=str)}"
                        for k, v in fields.items())
        head, sep, tail = line.partition("\n")  # a traceback stays below the fields
        return f"{head} {text}{sep}{tail}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, process, message, the action's fields, the
    extras, and the formatted exception when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "process": record.processName, "pid": record.process,
            "message": record.getMessage(),
        }
        doc.update(_fields(record))
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            doc["exception"] = record.exc_text
        return json.dumps(doc, default=str)


_FILTER = ActionFields()


def install(log_format: str, *loggers: logging.Logger) -> None:
    """Put the action filter and the chosen formatter on every handler of the root logger and of
    ``loggers`` (Celery's task logger does not propagate)."""
    formatter: logging.Formatter = JsonFormatter() if log_format == "json" else TextFormatter()
    for logger in (logging.getLogger(), *loggers):
        for handler in logger.handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)
            handler.setFormatter(formatter)
