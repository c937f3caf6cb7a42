"""Tickets: ``create_ticket`` honours the idempotency key; ``close_ticket`` checks the version only."""

from __future__ import annotations

import sqlite3
from typing import Any

from proofline_kit.sor.core import PathLike, Refused, plan_document, record_effect, settle
from proofline_kit.sor.db import next_id, now, reading, writing


def _ticket_result(row: sqlite3.Row, deduplicated: bool) -> dict[str, Any]:
    return {
        "ticket_id": row["id"],
        "status": row["status"],
        "version": row["version"],
        "deduplicated": deduplicated,
    }


def create_ticket(
    path: PathLike,
    tenant: str,
    title: str,
    owner: str,
    idempotency_key: str | None = None,
    priority: str | None = None,
) -> dict[str, Any]:
    """Open a ticket; a second call with the same key returns the first ticket and applies nothing.

    Returns ``{"ticket_id", "status", "version", "deduplicated"}``.
    """
    with writing(path) as conn:
        settle(conn)
        if idempotency_key is not None:
            row = conn.execute(
                "SELECT * FROM tickets WHERE idempotency_key = ?", (idempotency_key,)
            ).fetchone()
            if row is not None:
                return _ticket_result(row, deduplicated=True)
        ticket_id = next_id(conn, "tickets", "T")
        conn.execute(
            "INSERT INTO tickets (id, tenant, title, owner, status, version, idempotency_key, priority, created_at)"
            " VALUES (?, ?, ?, ?, 'open', 1, ?, ?, ?)",
            (ticket_id, tenant, title, owner, idempotency_key, priority, now()),
        )
        record_effect(
            conn,
            "create_ticket",
            idempotency_key,
            f"ticket:{ticket_id}",
            {"tenant": tenant, "title": title, "owner": owner, "priority": priority},
        )
        row = conn.execute("SELECT * FROM tickets WHERE id = ?", (ticket_id,)).fetchone()
        return _ticket_result(row, deduplicated=False)


def close_ticket(
    path: PathLike, ticket_id: str, expected_version: int, idempotency_key: str | None = None
) -> dict:
    """Close a ticket if its version is still ``expected_version`` (key recorded, not honoured).

    Returns ``{"ticket_id", "status", "version"}``; raises ``Refused`` (``not_found``, ``version_conflict``).
    """
    with writing(path) as conn:
        settle(conn)
        row = conn.execute("SELECT * FROM tickets WHERE id = ?", (ticket_id,)).fetchone()
        if row is None:
            raise Refused("not_found", f"no ticket {ticket_id}")
        if row["version"] != expected_version:
            raise Refused(
                "version_conflict", f"expected version {expected_version}, current {row['version']}"
            )
        version = row["version"] + 1
        conn.execute("UPDATE tickets SET status = 'closed', version = ? WHERE id = ?", (version, ticket_id))
        record_effect(
            conn,
            "close_ticket",
            idempotency_key,
            f"ticket:{ticket_id}",
            {"status": "closed", "version": version},
        )
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


def preview_close_ticket(path: PathLike, ticket_id: str, expected_version: int) -> dict[str, Any]:
    """What ``close_ticket`` would change now, read-only (the prepare tool of ``ticket.close``).

    Returns ``{"plan_id", "tool", "target", "target_version", "applicable", "refusal", "changes"}``:
    ``changes`` lists ``{"field", "before", "after"}``; a close that would be refused has
    ``applicable`` false, the refusal ``close_ticket`` would give (``not_found``,
    ``version_conflict``), and no changes. The plan id names
    the ticket and the version the plan was computed against, so an unchanged ticket gets the same id.
    """
    with reading(path) as conn:
        row = conn.execute("SELECT * FROM tickets WHERE id = ?", (ticket_id,)).fetchone()
    version = row["version"] if row is not None else None
    # Exactly the checks close_ticket makes (it checks the version only, not the status).
    refusal = "not_found" if row is None else "version_conflict" if version != expected_version else None
    changes = [] if refusal else [
        {"field": "status", "before": row["status"], "after": "closed"},
        {"field": "version", "before": version, "after": version + 1},
    ]
    return plan_document("close_ticket", f"ticket:{ticket_id}", f"close_ticket:{ticket_id}@{version}", version,
                         refusal, changes)
