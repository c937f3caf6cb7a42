"""The audit system's own store: entries copied from the system of record's effects log.

One writer (the feed) appends; the MCP server only reads. An entry is copied once its effect is at
least ``delay_seconds`` old, so the audit log lags the system of record by a known amount and a
verifier reading it must wait that long (the contract's ``consistency_delay_seconds``).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from proofline_kit.sor import db as sqlite_files

DEFAULT_DB = "./var/audit.sqlite3"
#: How far the audit log lags behind the system of record unless told otherwise.
DEFAULT_DELAY_SECONDS = 0.3

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY,          -- the effect's own sequence number in the system of record
    tool TEXT NOT NULL,
    idempotency_key TEXT,
    resource TEXT NOT NULL,
    detail TEXT NOT NULL,
    at REAL NOT NULL,                 -- when the system of record applied it
    ingested_at REAL NOT NULL         -- when the audit system learned of it
);
CREATE INDEX IF NOT EXISTS entries_by_key ON entries (idempotency_key);
CREATE INDEX IF NOT EXISTS entries_by_resource ON entries (resource);
"""


def resolve_path(path: str | os.PathLike[str] | None) -> Path:
    """``path``, else ``AUDIT_DB``, else ``./var/audit.sqlite3``."""
    return Path(path or os.environ.get("AUDIT_DB") or DEFAULT_DB)


def init_db(path: str | os.PathLike[str] | None = None) -> sqlite3.Connection:
    """Create the file and schema; returns the writer's connection (keep it open: a reader on a
    read-only mount can open a WAL database only while its -shm file exists)."""
    conn = sqlite_files.connect(resolve_path(path))
    conn.executescript(SCHEMA)
    return conn


def open_source(sor_db: str | os.PathLike[str]) -> sqlite3.Connection:
    """A read-only connection to the system of record's file, kept by the feed between copies. (Never
    the immutable fallback of a read-only mount: a connection kept open must see new commits.)"""
    conn = sqlite3.connect(f"{Path(sor_db).resolve().as_uri()}?mode=ro", uri=True, isolation_level=None,
                           timeout=sqlite_files.BUSY_TIMEOUT_MS / 1000)
    conn.row_factory = sqlite3.Row
    return conn


def ingest(conn: sqlite3.Connection, sor: sqlite3.Connection, delay_seconds: float) -> int:
    """Copy every effect of the system of record (read through ``sor``) older than ``delay_seconds``
    that the audit log does not hold yet; returns how many were copied."""
    last = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM entries").fetchone()[0]
    cutoff = time.time() - delay_seconds
    rows = sor.execute("SELECT seq, tool, idempotency_key, resource, detail, at FROM effects"
                       " WHERE seq > ? AND at <= ? ORDER BY seq", (last, cutoff)).fetchall()
    if not rows:
        return 0
    stamp = time.time()
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany("INSERT OR IGNORE INTO entries (seq, tool, idempotency_key, resource, detail, at,"
                         " ingested_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                         [(r["seq"], r["tool"], r["idempotency_key"], r["resource"], r["detail"], r["at"], stamp)
                          for r in rows])
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return len(rows)


def _entries(path: str | os.PathLike[str] | None, where: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
    with sqlite_files.reading(resolve_path(path)) as conn:
        rows = conn.execute(f"SELECT * FROM entries WHERE {where} ORDER BY seq", args).fetchall()
    return [{**dict(r), "detail": json.loads(r["detail"])} for r in rows]


def find_entries(path: str | os.PathLike[str] | None, idempotency_key: str) -> dict[str, Any]:
    """``{"found", "count", "entries"}``: every audited effect carried out under ``idempotency_key``."""
    entries = _entries(path, "idempotency_key = ?", (idempotency_key,))
    return {"found": bool(entries), "count": len(entries), "entries": entries}


def search(path: str | os.PathLike[str] | None, idempotency_key: str | None = None,
           operation_id: str | None = None) -> dict[str, Any]:
    """Audited effects by idempotency key and/or downstream operation id (``detail.operation_id``)."""
    if not idempotency_key and not operation_id:
        raise ValueError("search needs an idempotency_key or an operation_id")
    entries = _entries(path, "(? IS NULL OR idempotency_key = ?) AND (? IS NULL OR"
                             " json_extract(detail, '$.operation_id') = ?)",
                       (idempotency_key, idempotency_key, operation_id, operation_id))
    return {"found": bool(entries), "count": len(entries), "entries": entries}


def service_view(path: str | os.PathLike[str] | None, service: str) -> dict[str, Any]:
    """The monitoring view of one service: the restarts monitoring has observed, oldest first."""
    entries = _entries(path, "resource = ? AND tool = 'restart_service'", (f"service:{service}",))
    restarts = [{"idempotency_key": e["idempotency_key"], "operation_id": e["detail"].get("operation_id"),
                 "generation": e["detail"].get("generation"), "at": e["at"]} for e in entries]
    return {"service": service, "restarts": restarts, "count": len(restarts)}
