"""The system of record's domain operations over SQLite, and the facade other code imports.

Every mutation runs in one ``BEGIN IMMEDIATE`` transaction that also appends its ``effects`` row,
so the effects table is exact ground truth: a test can count how many times a write really
happened per idempotency key. Only ``create_ticket`` and ``reverse_refund`` honour the key; the
others record it but apply again on every call, as many real enterprise APIs do.

Asynchronous restarts finish lazily: writers persist any operation whose ``ready_at`` has
passed at the start of their transaction; readers (possibly on a read-only connection) compute
the same settled view without writing, so both roles always agree.
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import Any

from proofline.sor.db import connect, init_db, next_id, now, reading, resolve_path, writing
from proofline.sor.faults import READ_OUTAGE, Fault, clear_faults, list_faults, set_fault, set_read_outage, take_fault
from proofline.sor.seed import bump_version, put_account, put_service, put_ticket, reset_db, seed_demo

__all__ = [
    "Refused", "init_db", "resolve_path", "connect", "set_fault", "clear_faults", "set_read_outage", "take_fault",
    "list_faults", "Fault", "READ_OUTAGE", "seed_demo", "reset_db", "put_ticket", "put_service", "put_account",
    "bump_version", "effects", "count_effects", "create_ticket", "close_ticket", "restart_service",
    "issue_refund", "reverse_refund", "get_ticket", "find_ticket_by_key", "get_service", "get_operation",
    "get_account", "find_refund_by_key", "phantom_id",
]

PathLike = str | os.PathLike[str] | None


class Refused(Exception):
    """A mutation refused before any side effect; ``reason`` is a stable code like ``version_conflict``."""

    error_class = "failed_before_side_effect"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = f"{reason}: {message}"


def _effect(conn: sqlite3.Connection, tool: str, key: str | None, resource: str, detail: dict[str, Any]) -> None:
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


def count_effects(path: PathLike, idempotency_key: str) -> int:
    """How many mutations were really applied under ``idempotency_key``."""
    with reading(path) as conn:
        return conn.execute("SELECT COUNT(*) FROM effects WHERE idempotency_key = ?", (idempotency_key,)).fetchone()[0]


def phantom_id(path: PathLike, table: str, prefix: str) -> str:
    """An id that looks real but names nothing (for the ``lie`` fault): far above the next real id."""
    with reading(path) as conn:
        return f"{prefix}-{90000 + int(next_id(conn, table, prefix).split('-')[1])}"


# --- asynchronous operations --------------------------------------------------------------------


def _settled_operation(op: sqlite3.Row | None, at: float) -> dict[str, Any] | None:
    if op is None:
        return None
    view = dict(op)
    if view["state"] == "running" and view["ready_at"] <= at:
        view["state"] = "completed"
    return view


def _settled_service(conn: sqlite3.Connection, svc: sqlite3.Row | None, at: float) -> dict[str, Any] | None:
    """The service as it is at ``at``: a due restart shows as finished, exactly as ``_settle`` would write it."""
    if svc is None:
        return None
    view = dict(svc)
    if view["active_operation"]:
        op = conn.execute("SELECT * FROM operations WHERE id = ?", (view["active_operation"],)).fetchone()
        if op is not None and op["state"] == "running" and op["ready_at"] <= at:
            view.update(state="running", healthy_instances=view["instances"], active_operation=None,
                        generation=view["generation"] + 1)
    return view


def _settle(conn: sqlite3.Connection) -> None:
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
        _effect(conn, "operation_completed", None, f"service:{op['service']}", {"operation_id": op["id"]})


# --- tickets ------------------------------------------------------------------------------------


def _ticket_result(row: sqlite3.Row, deduplicated: bool) -> dict[str, Any]:
    return {"ticket_id": row["id"], "status": row["status"], "version": row["version"], "deduplicated": deduplicated}


def create_ticket(
    path: PathLike, tenant: str, title: str, owner: str, idempotency_key: str | None = None, priority: str | None = None
) -> dict[str, Any]:
    """Open a ticket; a second call with the same key returns the first ticket and applies nothing.

    Returns ``{"ticket_id", "status", "version", "deduplicated"}``.
    """
    with writing(path) as conn:
        _settle(conn)
        if idempotency_key is not None:
            row = conn.execute("SELECT * FROM tickets WHERE idempotency_key = ?", (idempotency_key,)).fetchone()
            if row is not None:
                return _ticket_result(row, deduplicated=True)
        ticket_id = next_id(conn, "tickets", "T")
        conn.execute(
            "INSERT INTO tickets (id, tenant, title, owner, status, version, idempotency_key, priority, created_at)"
            " VALUES (?, ?, ?, ?, 'open', 1, ?, ?, ?)",
            (ticket_id, tenant, title, owner, idempotency_key, priority, now()),
        )
        _effect(conn, "create_ticket", idempotency_key, f"ticket:{ticket_id}",
                {"tenant": tenant, "title": title, "owner": owner, "priority": priority})
        row = conn.execute("SELECT * FROM tickets WHERE id = ?", (ticket_id,)).fetchone()
        return _ticket_result(row, deduplicated=False)


def close_ticket(path: PathLike, ticket_id: str, expected_version: int, idempotency_key: str | None = None) -> dict:
    """Close a ticket if its version is still ``expected_version`` (key recorded, not honoured).

    Returns ``{"ticket_id", "status", "version"}``; raises ``Refused`` (``not_found``, ``version_conflict``).
    """
    with writing(path) as conn:
        _settle(conn)
        row = conn.execute("SELECT * FROM tickets WHERE id = ?", (ticket_id,)).fetchone()
        if row is None:
            raise Refused("not_found", f"no ticket {ticket_id}")
        if row["version"] != expected_version:
            raise Refused("version_conflict", f"expected version {expected_version}, current {row['version']}")
        version = row["version"] + 1
        conn.execute("UPDATE tickets SET status = 'closed', version = ? WHERE id = ?", (version, ticket_id))
        _effect(conn, "close_ticket", idempotency_key, f"ticket:{ticket_id}", {"status": "closed", "version": version})
        return {"ticket_id": ticket_id, "status": "closed", "version": version}


def get_ticket(path: PathLike, ticket_id: str) -> dict[str, Any]:
    """``{"found": bool, "ticket": {...} | None}``."""
    with reading(path) as conn:
        row = conn.execute("SELECT * FROM tickets WHERE id = ?", (ticket_id,)).fetchone()
    return {"found": row is not None, "ticket": dict(row) if row else None}


def find_ticket_by_key(path: PathLike, idempotency_key: str) -> dict[str, Any]:
    """``{"found": bool, "ticket": {...} | None}`` for the ticket created under ``idempotency_key``."""
    with reading(path) as conn:
        row = conn.execute("SELECT * FROM tickets WHERE idempotency_key = ?", (idempotency_key,)).fetchone()
    return {"found": row is not None, "ticket": dict(row) if row else None}


# --- services -----------------------------------------------------------------------------------


def restart_service(
    path: PathLike, service: str, tenant: str, expected_generation: int,
    idempotency_key: str | None = None, restart_seconds: float | None = None,
) -> dict[str, Any]:
    """Start an asynchronous restart (key recorded, not honoured); returns ``{"operation_id", "state": "accepted"}``.

    Refuses (``not_found``, ``tenant_mismatch``, ``conflicting_operation``, ``version_conflict``).
    The operation completes ``restart_seconds`` later (default env ``SOR_RESTART_SECONDS``, 1.0).
    """
    if restart_seconds is None:
        restart_seconds = float(os.environ.get("SOR_RESTART_SECONDS", "1.0"))
    with writing(path) as conn:
        _settle(conn)
        svc = conn.execute("SELECT * FROM services WHERE name = ?", (service,)).fetchone()
        if svc is None:
            raise Refused("not_found", f"no service {service}")
        if svc["tenant"] != tenant:
            raise Refused("tenant_mismatch", f"service {service} does not belong to tenant {tenant}")
        if svc["active_operation"]:
            raise Refused("conflicting_operation", f"operation {svc['active_operation']} is still running")
        if svc["generation"] != expected_generation:
            raise Refused("version_conflict", f"expected generation {expected_generation}, current {svc['generation']}")
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
        _effect(conn, "restart_service", idempotency_key, f"service:{service}",
                {"operation_id": op_id, "generation": svc["generation"] + 1})
        return {"operation_id": op_id, "state": "accepted"}


def get_service(path: PathLike, service: str) -> dict[str, Any] | None:
    """The service document (settled as of now), or ``None``."""
    with reading(path) as conn:
        svc = conn.execute("SELECT * FROM services WHERE name = ?", (service,)).fetchone()
        return _settled_service(conn, svc, now())


def get_operation(path: PathLike, operation_id: str) -> dict[str, Any]:
    """``{"found": bool, "operation": {...} | None}`` (settled as of now)."""
    with reading(path) as conn:
        op = conn.execute("SELECT * FROM operations WHERE id = ?", (operation_id,)).fetchone()
    view = _settled_operation(op, now())
    return {"found": view is not None, "operation": view}


# --- refunds ------------------------------------------------------------------------------------


def issue_refund(
    path: PathLike, account: str, tenant: str, amount_cents: int, reason: str, idempotency_key: str | None = None
) -> dict[str, Any]:
    """Pay a refund out of ``account`` (key recorded, not honoured: every call refunds again).

    Returns ``{"refund_id", "account", "amount_cents", "balance_cents"}``; raises ``Refused``.
    """
    if amount_cents <= 0:
        raise Refused("invalid_amount", "amount_cents must be positive")
    with writing(path) as conn:
        _settle(conn)
        acct = conn.execute("SELECT * FROM accounts WHERE id = ?", (account,)).fetchone()
        if acct is None:
            raise Refused("not_found", f"no account {account}")
        if acct["tenant"] != tenant:
            raise Refused("tenant_mismatch", f"account {account} does not belong to tenant {tenant}")
        if acct["balance_cents"] < amount_cents:
            raise Refused("insufficient_balance", f"balance {acct['balance_cents']} < {amount_cents}")
        refund_id = next_id(conn, "refunds", "R")
        balance = acct["balance_cents"] - amount_cents
        conn.execute(
            "INSERT INTO refunds (id, account, tenant, amount_cents, reason, status, idempotency_key, created_at)"
            " VALUES (?, ?, ?, ?, ?, 'issued', ?, ?)",
            (refund_id, account, tenant, amount_cents, reason, idempotency_key, now()),
        )
        conn.execute("UPDATE accounts SET balance_cents = ?, version = version + 1 WHERE id = ?", (balance, account))
        _effect(conn, "issue_refund", idempotency_key, f"refund:{refund_id}",
                {"account": account, "amount_cents": amount_cents, "balance_cents": balance})
        return {"refund_id": refund_id, "account": account, "amount_cents": amount_cents, "balance_cents": balance}


def reverse_refund(path: PathLike, refund_id: str, idempotency_key: str | None = None) -> dict[str, Any]:
    """Compensate a refund: mark it reversed and give the amount back to the account.

    Idempotent: a refund already reversed (by this key or any other) is returned with
    ``deduplicated: True`` and nothing applied. Returns ``{"refund_id", "status", "deduplicated"}``.
    """
    with writing(path) as conn:
        _settle(conn)
        refund = conn.execute("SELECT * FROM refunds WHERE id = ?", (refund_id,)).fetchone()
        if refund is None:
            raise Refused("not_found", f"no refund {refund_id}")
        if refund["status"] == "reversed":
            return {"refund_id": refund_id, "status": "reversed", "deduplicated": True}
        conn.execute("UPDATE refunds SET status = 'reversed', reversal_key = ? WHERE id = ?", (idempotency_key, refund_id))
        conn.execute(
            "UPDATE accounts SET balance_cents = balance_cents + ?, version = version + 1 WHERE id = ?",
            (refund["amount_cents"], refund["account"]),
        )
        _effect(conn, "reverse_refund", idempotency_key, f"refund:{refund_id}",
                {"account": refund["account"], "amount_cents": refund["amount_cents"]})
        return {"refund_id": refund_id, "status": "reversed", "deduplicated": False}


def get_account(path: PathLike, account: str) -> dict[str, Any]:
    """``{"found": bool, "account": {...} | None, "refunds": [...]}`` (refunds oldest first)."""
    with reading(path) as conn:
        acct = conn.execute("SELECT * FROM accounts WHERE id = ?", (account,)).fetchone()
        refunds = conn.execute("SELECT * FROM refunds WHERE account = ? ORDER BY CAST(SUBSTR(id, 3) AS INTEGER)", (account,)).fetchall()
    return {"found": acct is not None, "account": dict(acct) if acct else None, "refunds": [dict(r) for r in refunds]}


def find_refund_by_key(path: PathLike, idempotency_key: str) -> dict[str, Any]:
    """``{"found": bool, "refund": first | None, "refunds": [all]}``: the key is not unique for refunds."""
    with reading(path) as conn:
        rows = conn.execute(
            "SELECT * FROM refunds WHERE idempotency_key = ? ORDER BY CAST(SUBSTR(id, 3) AS INTEGER)", (idempotency_key,)
        ).fetchall()
    refunds = [dict(r) for r in rows]
    return {"found": bool(refunds), "refund": refunds[0] if refunds else None, "refunds": refunds}
