"""Shared pieces of the domain modules: refusals, the effects log and lazy operation settlement.

Every mutation appends its ``effects`` row inside its own transaction, so the effects table is
exact ground truth: tests count how many times a write really happened per idempotency key.

Asynchronous restarts finish lazily: writers persist any operation whose ``ready_at`` has passed
at the start of their transaction (``settle``); readers, possibly on a read-only connection,
compute the same settled view without writing, so both roles always agree.
"""

from __future__ import annotations

import json
import os
import sqlite3
from contextvars import ContextVar
from typing import Any

from proofline_kit.sor.db import next_id, now, reading, writing

PathLike = str | os.PathLike[str] | None


class Refused(Exception):
    """A mutation refused before any side effect; ``reason`` is a stable code like ``version_conflict``."""

    error_class = "failed_before_side_effect"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = f"{reason}: {message}"


#: Set by the ``lie_consistently`` fault: the server writes its own record of a mutation (so its
#: own reads agree with its answer) but the effect itself never happens, so no effects row is
#: appended and nothing downstream of the effects log (the audit system) ever sees it.
unapplied: ContextVar[bool] = ContextVar("unapplied", default=False)


def record_effect(
    conn: sqlite3.Connection, tool: str, key: str | None, resource: str, detail: dict[str, Any]
) -> None:
    """Append the effects row for a mutation; call inside the mutation's transaction."""
    if unapplied.get():
        return
    conn.execute(
        "INSERT INTO effects (tool, idempotency_key, resource, detail, at) VALUES (?, ?, ?, ?, ?)",
        (tool, key, resource, json.dumps(detail, sort_keys=True), now()),
    )


def effects(path: PathLike, idempotency_key: str | None = None) -> list[dict[str, Any]]:
    """Applied mutations in order (all, or only those carrying ``idempotency_key``); ``detail`` decoded."""
    with reading(path) as conn:
        if idempotency_key is None:
            rows = conn.execute("SELECT * FROM effects ORDER BY seq").fetchall()
        else:
            rows = conn.execute(
                "SELECT * FROM effects WHERE idempotency_key = ? ORDER BY seq", (idempotency_key,)
            ).fetchall()
    return [{**dict(r), "detail": json.loads(r["detail"])} for r in rows]


def record_cancellation(path: PathLike, tool: str, key: str | None, disposition: str, detail: str = "") -> None:
    """Log a ``notifications/cancelled`` the server received for a call in flight, and what it did
    with it (``honoured``: stopped before any effect; ``ignored``: applied the write anyway)."""
    with writing(path) as conn:
        conn.execute("INSERT INTO cancellations (tool, idempotency_key, disposition, at) VALUES (?, ?, ?, ?)",
                     (tool, key, f"{disposition}{': ' + detail if detail else ''}", now()))


def cancellations(path: PathLike, idempotency_key: str) -> list[dict[str, Any]]:
    """Every cancellation the server received for calls carrying ``idempotency_key``, in order."""
    with reading(path) as conn:
        rows = conn.execute("SELECT tool, disposition, at FROM cancellations WHERE idempotency_key = ? ORDER BY seq",
                            (idempotency_key,)).fetchall()
    return [dict(r) for r in rows]


def count_effects(path: PathLike, idempotency_key: str) -> int:
    """How many mutations were really applied under ``idempotency_key``."""
    with reading(path) as conn:
        return conn.execute(
            "SELECT COUNT(*) FROM effects WHERE idempotency_key = ?", (idempotency_key,)
        ).fetchone()[0]


def phantom_id(path: PathLike, table: str, prefix: str) -> str:
    """An id that looks real but names nothing (for the ``lie`` fault): far above the next real id."""
    with reading(path) as conn:
        return f"{prefix}-{90000 + int(next_id(conn, table, prefix).split('-')[1])}"


def settled_operation(op: sqlite3.Row | None, at: float) -> dict[str, Any] | None:
    """The operation as it is at ``at``: running past ``ready_at`` shows as completed."""
    if op is None:
        return None
    view = dict(op)
    if view["state"] == "running" and view["ready_at"] <= at:
        view["state"] = "completed"
    return view


def settled_service(conn: sqlite3.Connection, svc: sqlite3.Row | None, at: float) -> dict[str, Any] | None:
    """The service as it is at ``at``: a due restart shows as finished, exactly as ``settle`` would write it."""
    if svc is None:
        return None
    view = dict(svc)
    if view["active_operation"]:
        op = conn.execute("SELECT * FROM operations WHERE id = ?", (view["active_operation"],)).fetchone()
        if op is not None and op["state"] == "running" and op["ready_at"] <= at:
            view.update(
                state="running",
                healthy_instances=view["instances"],
                active_operation=None,
                generation=view["generation"] + 1,
            )
    return view


def settle(conn: sqlite3.Connection) -> None:
    """Persist every due operation; called first in each write transaction."""
    at = now()
    due = conn.execute("SELECT * FROM operations WHERE state = 'running' AND ready_at <= ?", (at,)).fetchall()
    for op in due:
        conn.execute("UPDATE operations SET state = 'completed' WHERE id = ?", (op["id"],))
        conn.execute(
            "UPDATE services SET state = 'running', healthy_instances = instances, active_operation = NULL,"
            " generation = generation + 1 WHERE name = ? AND active_operation = ?",
            (op["service"], op["id"]),
        )
        record_effect(
            conn, "operation_completed", None, f"service:{op['service']}", {"operation_id": op["id"]}
        )


def plan_document(tool: str, target: str, plan_id: str, version: int | None, refusal: str | None,
                  changes: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer of every ``preview_*`` tool: what ``tool`` would change on ``target`` now, or the
    refusal it would give (then nothing changes)."""
    return {"plan_id": plan_id, "tool": tool, "target": target, "target_version": version,
            "applicable": refusal is None, "refusal": refusal, "changes": [] if refusal else changes}
