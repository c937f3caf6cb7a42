"""Services and their asynchronous restart operations (the key is recorded, never honoured)."""

from __future__ import annotations

import os
from typing import Any

from proofline_kit.sor.core import (
    PathLike,
    Refused,
    record_effect,
    settle,
    settled_operation,
    settled_service,
)
from proofline_kit.sor.db import next_id, now, reading, writing


def restart_service(
    path: PathLike,
    service: str,
    tenant: str,
    expected_generation: int,
    idempotency_key: str | None = None,
    restart_seconds: float | None = None,
    record_ttl_seconds: float | None = None,
) -> dict[str, Any]:
    """Start an asynchronous restart (key recorded, not honoured); returns ``{"operation_id", "state": "accepted"}``.

    Refuses (``not_found``, ``tenant_mismatch``, ``conflicting_operation``, ``version_conflict``).
    The operation completes ``restart_seconds`` later (default env ``SOR_RESTART_SECONDS``, 1.0).
    Its status record expires ``record_ttl_seconds`` after it started (default env
    ``SOR_OPERATION_TTL_SECONDS``, 3600): from then on ``get_operation`` no longer finds it, as a
    task store that deletes finished tasks after their time to live.
    """
    if restart_seconds is None:
        restart_seconds = float(os.environ.get("SOR_RESTART_SECONDS", "1.0"))
    if record_ttl_seconds is None:
        record_ttl_seconds = float(os.environ.get("SOR_OPERATION_TTL_SECONDS", "3600"))
    with writing(path) as conn:
        settle(conn)
        svc = conn.execute("SELECT * FROM services WHERE name = ?", (service,)).fetchone()
        if svc is None:
            raise Refused("not_found", f"no service {service}")
        if svc["tenant"] != tenant:
            raise Refused("tenant_mismatch", f"service {service} does not belong to tenant {tenant}")
        if svc["active_operation"]:
            raise Refused("conflicting_operation", f"operation {svc['active_operation']} is still running")
        if svc["generation"] != expected_generation:
            raise Refused(
                "version_conflict", f"expected generation {expected_generation}, current {svc['generation']}"
            )
        op_id = next_id(conn, "operations", "op")
        started = now()
        conn.execute(
            "INSERT INTO operations (id, kind, service, tenant, state, started_at, ready_at, idempotency_key,"
            " expires_at) VALUES (?, 'restart', ?, ?, 'running', ?, ?, ?, ?)",
            (op_id, service, tenant, started, started + restart_seconds, idempotency_key,
             started + record_ttl_seconds),
        )
        conn.execute(
            "UPDATE services SET state = 'restarting', healthy_instances = 0, active_operation = ?,"
            " generation = generation + 1 WHERE name = ?",
            (op_id, service),
        )
        record_effect(
            conn,
            "restart_service",
            idempotency_key,
            f"service:{service}",
            {"operation_id": op_id, "generation": svc["generation"] + 1},
        )
        return {"operation_id": op_id, "state": "accepted"}


def get_service(path: PathLike, service: str, as_of: float | None = None) -> dict[str, Any] | None:
    """The service document (settled as of now), or ``None``. With ``as_of`` (wall-clock seconds
    in the past), the document as it stood then: what a replica lagging behind the writer shows."""
    with reading(path) as conn:
        svc = conn.execute("SELECT * FROM services WHERE name = ?", (service,)).fetchone()
        view = settled_service(conn, svc, now())
        if view is None or as_of is None:
            return view
        return _service_as_of(conn, view, as_of)


def _service_as_of(conn: Any, view: dict[str, Any], at: float) -> dict[str, Any]:
    """Undo, on the settled view, every restart step that happened after ``at``: a restart adds one
    generation when it starts and one when it finishes."""
    current = now()
    running_at = None
    ops = conn.execute("SELECT id, started_at, ready_at FROM operations WHERE service = ? AND ready_at > ?",
                       (view["name"], at)).fetchall()
    for op in ops:
        finished = op["ready_at"] <= current
        if op["started_at"] > at:
            view["generation"] -= 2 if finished else 1
        else:
            view["generation"] -= 1 if finished else 0
            running_at = op["id"]
    if running_at is None:
        view.update(state="running", healthy_instances=view["instances"], active_operation=None)
    else:
        view.update(state="restarting", healthy_instances=0, active_operation=running_at)
    return view


def get_operation(path: PathLike, operation_id: str) -> dict[str, Any]:
    """``{"found": bool, "operation": {...} | None}`` (settled as of now). Past its time to live the
    record is no longer served: ``found`` is false and ``expired_at`` says when it went."""
    with reading(path) as conn:
        op = conn.execute("SELECT * FROM operations WHERE id = ?", (operation_id,)).fetchone()
    at = now()
    if op is not None and op["expires_at"] is not None and op["expires_at"] <= at:
        return {"found": False, "operation": None, "expired_at": op["expires_at"]}
    view = settled_operation(op, at)
    return {"found": view is not None, "operation": view}
