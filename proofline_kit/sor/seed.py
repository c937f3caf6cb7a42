"""Seeding and test-setup helpers: put records in place directly, without going through tools.

These writes are set-up, not tool effects, so they add no ``effects`` rows, except
``bump_version``, which simulates somebody else changing a resource and is recorded as an
``external_change`` effect (it is a real change to the record that a verifier may see).
"""

from __future__ import annotations

import json
import os

from proofline_kit.sor.db import init_db, next_id, now, writing

PathLike = str | os.PathLike[str] | None


def reset_db(path: PathLike) -> None:
    """Create the schema if needed and delete every row (faults included)."""
    init_db(path)
    with writing(path) as conn:
        for table in ("tickets", "services", "operations", "accounts", "refunds", "effects", "faults",
                      "cancellations"):
            conn.execute(f"DELETE FROM {table}")
        conn.execute("DELETE FROM sqlite_sequence WHERE name = 'effects'")


def put_ticket(path: PathLike, tenant: str, title: str, owner: str, status: str = "open") -> str:
    """Insert a ticket (version 1, no idempotency key) and return its id."""
    with writing(path) as conn:
        ticket_id = next_id(conn, "tickets", "T")
        conn.execute(
            "INSERT INTO tickets (id, tenant, title, owner, status, version, created_at) VALUES (?, ?, ?, ?, ?, 1, ?)",
            (ticket_id, tenant, title, owner, status, now()),
        )
    return ticket_id


def put_service(path: PathLike, name: str, tenant: str, version: str = "1.0.0", instances: int = 3) -> None:
    """Insert or replace a healthy running service at generation 1."""
    with writing(path) as conn:
        conn.execute(
            "INSERT OR REPLACE INTO services (name, tenant, version, state, healthy_instances, instances,"
            " generation, active_operation) VALUES (?, ?, ?, 'running', ?, ?, 1, NULL)",
            (name, tenant, version, instances, instances),
        )


def put_account(path: PathLike, account_id: str, tenant: str, balance_cents: int) -> None:
    """Insert or replace an account at version 1."""
    with writing(path) as conn:
        conn.execute(
            "INSERT OR REPLACE INTO accounts (id, tenant, balance_cents, version) VALUES (?, ?, ?, 1)",
            (account_id, tenant, balance_cents),
        )


_VERSION_COLUMN = {
    "ticket": ("tickets", "id", "version"),
    "service": ("services", "name", "generation"),
    "account": ("accounts", "id", "version"),
}


def bump_version(path: PathLike, kind: str, ident: str) -> int:
    """Simulate a concurrent change: add 1 to a ticket/account version or a service generation.

    ``kind`` is ``ticket``, ``service`` or ``account``. Returns the new version.
    """
    table, key, column = _VERSION_COLUMN[kind]
    with writing(path) as conn:
        row = conn.execute(f"SELECT {column} FROM {table} WHERE {key} = ?", (ident,)).fetchone()
        if row is None:
            raise KeyError(f"no {kind} {ident!r}")
        new = row[0] + 1
        conn.execute(f"UPDATE {table} SET {column} = ? WHERE {key} = ?", (new, ident))
        conn.execute(
            "INSERT INTO effects (tool, idempotency_key, resource, detail, at) VALUES ('external_change', NULL, ?, ?, ?)",
            (f"{kind}:{ident}", json.dumps({column: new}), now()),
        )
    return new


def seed_demo(path: PathLike) -> dict[str, object]:
    """Reset the database and load a small fixed data set; returns what was created.

    Tenants ``acme`` and ``globex`` get a few tickets; ``acme`` runs ``checkout`` and ``search``
    (3 instances each) and owns account ``acct-1`` with 100 000 cents; ``globex`` owns ``acct-2``.
    """
    reset_db(path)
    tickets = [
        put_ticket(path, "acme", "Checkout latency above SLO", "alice"),
        put_ticket(path, "acme", "Search index stale", "bob"),
        put_ticket(path, "globex", "VPN certificate expiring", "carol"),
    ]
    put_service(path, "checkout", "acme", version="1.4.2", instances=3)
    put_service(path, "search", "acme", version="2.0.1", instances=3)
    put_account(path, "acct-1", "acme", 100_000)
    put_account(path, "acct-2", "globex", 50_000)
    return {"tickets": tickets, "services": ["checkout", "search"], "accounts": ["acct-1", "acct-2"]}
