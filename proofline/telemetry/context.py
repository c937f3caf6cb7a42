"""The action a worker is handling now, for log lines, counters' labels and spans.

Set when a task knows its action (after validating the envelope, after loading the row); every
log record of the task then carries its action id, run id, tenant and stage
(``proofline/telemetry/logs.py``)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ActionContext:
    action_id: str
    run_id: str | None = None
    tenant: str | None = None
    action_type: str | None = None
    stage: str | None = None


_current: ContextVar[ActionContext | None] = ContextVar("proofline_action", default=None)


def bind(action_id: str, *, run_id: str | None = None, tenant: str | None = None, action_type: str | None = None,
         irreversible: Any = False, stage: str | None = None) -> None:
    """Name the action this task handles (and remember its labels for the counters)."""
    from proofline.telemetry.metrics import ACTIONS

    _current.set(ActionContext(action_id, run_id, tenant, action_type, stage))
    if action_type:
        ACTIONS.remember(action_id, action_type, irreversible, tenant)


def stage(name: str) -> None:
    """The stage the current action is in (validate, execute, verify, recover, ...)."""
    ctx = _current.get()
    if ctx is not None:
        _current.set(replace(ctx, stage=name))


def current() -> ActionContext | None:
    return _current.get()


def clear() -> None:
    _current.set(None)
