"""Sandbox audit findings into the ledger: a ``sandbox_violation`` event per finding, on the action
whose call was in flight when the sandbox denied it (worker/sandbox_audit.py, worker/mcp_client.py).
Requests the server sent the worker mid-call (``server_request``, worker/server_requests.py) travel
the same way, each under its own event name.

A finding made while no action's call was in flight (between calls) goes on the action that takes
it, with ``in_flight: false``. Evidence is redacted like every event: by the policy and by the
action's own redactor (a path built from a secret argument keeps none of it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import psycopg

from ledger import store
from ledger.redact import Redactor, current_redactor
from worker.runtime import Runtime

EVENT = "sandbox_violation"
T = TypeVar("T")
log = logging.getLogger(__name__)


Pending = tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]] | None


def pending(rt: Runtime, action_id: str) -> Pending:
    """The findings not yet recorded: this action's, and other actions' by their id."""
    own: list[dict[str, Any]] = []
    others: dict[str, list[dict[str, Any]]] = {}
    if "mcp" not in vars(rt):
        return own, others  # no session was ever opened by this runtime: nothing to take
    for found in rt.mcp.take_audit():
        target = found.pop("action_id", None) or action_id
        (own if target == action_id else others.setdefault(target, [])).append(found)
    return own, others


def _events(items: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    # A server's request (worker/server_requests.py) names its own event; an audit finding is a violation.
    return [(f.get("_event", EVENT), {k: v for k, v in f.items() if k != "_event"}) for f in items]


def write_pending_txn(cur: Any, rt: Runtime, action_id: str, found: Pending) -> list[tuple[str, dict[str, Any]]]:
    """Append other actions' findings on their chains; return this action's as events to append."""
    own, others = found or ([], {})
    for other, items in others.items():
        store.append_events_txn(cur, other, rt.settings.worker_id, _events(items))
    return _events(own)


def flush(rt: Runtime, action_id: str, redactor: Redactor | None = None) -> int:
    """Record every finding still pending (own transaction); returns how many were recorded."""
    found = pending(rt, action_id)
    if not found[0] and not found[1]:
        return 0
    red = redactor or current_redactor.get()

    def write() -> None:
        with store.transaction(rt.conn) as cur:
            store.append_events_txn(cur, action_id, rt.settings.worker_id, write_pending_txn(cur, rt, action_id, found),
                                    red)

    try:
        write()
    except psycopg.OperationalError:
        rt.reset_connection()  # the session died while the call ran; the findings are still ours to write
        write()
    return len(found[0]) + sum(len(f) for f in found[1].values())


def records_audit(fn: Callable[..., T]) -> Callable[..., T]:
    """Wrap a task body that sets ``rt.mcp.action_id``: what the audit found during its calls and
    was not recorded with a result (a refused read, a preflight that stopped) is recorded at the end."""

    @wraps(fn)
    def wrapper(rt: Runtime, *args: Any, **kwargs: Any) -> T:
        try:
            return fn(rt, *args, **kwargs)
        finally:
            action_id = rt.mcp.action_id if "mcp" in vars(rt) else None
            if action_id is not None:
                rt.mcp.action_id = None
                rt.mcp.request_policy = None
                try:
                    flush(rt, action_id)
                except psycopg.Error as exc:  # counted and logged when found; never mask the task's own end
                    log.error("sandbox violations not recorded: %s", exc, extra={"event": "sandbox_violation_lost",
                                                                                 "action_id": action_id})

    return wrapper
