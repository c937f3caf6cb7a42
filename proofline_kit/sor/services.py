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
) -> dict[str, Any]:
    """Start an asynchronous restart (key recorded, not honoured); returns ``{"operation_id", "state": "accepted"}``.

    Refuses (``not_found``, ``tenant_mismatch``, ``conflicting_operation``, ``version_conflict``).
    The operation completes ``restart_seconds`` later (default env ``SOR_RESTART_SECONDS``, 1.0).
    """
    if restart_seconds is None:
        restart_seconds = float(os.environ.get("SOR_RESTART_SECONDS", "1.0"))
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
            "INSERT INTO operations (id, kind, service, tenant, state, started_at, ready_at, idempotency_key)"
            " VALUES (?, 'restart', ?, ?, 'running', ?, ?, ?)",
            (op_id, service, tenant, started, started + restart_seconds, idempotency_key),
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


def get_service(path: PathLike, service: str) -> dict[str, Any] | None:
    """The service document (settled as of now), or ``None``."""
    with reading(path) as conn:
        svc = conn.execute("SELECT * FROM services WHERE name = ?", (service,)).fetchone()
        return settled_service(conn, svc, now())


def get_operation(path: PathLike, operation_id: str) -> dict[str, Any]:
    """``{"found": bool, "operation": {...} | None}`` (settled as of now)."""
    with reading(path) as conn:
        op = conn.execute("SELECT * FROM operations WHERE id = ?", (operation_id,)).fetchone()
    view = settled_operation(op, now())
    return {"found": view is not None, "operation": view}
