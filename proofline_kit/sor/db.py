"""SQLite plumbing for the system of record: where the file lives, how to open it, the schema.

Several processes share one file (a writer server, a read-only server, test code), so every
connection uses WAL and a busy timeout, and every write runs under ``BEGIN IMMEDIATE`` so two
writers queue on the file lock instead of failing half-way through a read-modify-write.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DEFAULT_DB = "./var/sor.sqlite3"
BUSY_TIMEOUT_MS = 5000

SCHEMA = """
CREATE TABLE IF NOT EXISTS tickets (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    title TEXT NOT NULL,
    owner TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('open', 'closed')),
    version INTEGER NOT NULL,
    idempotency_key TEXT UNIQUE,
    priority TEXT,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS services (
    name TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    version TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('running', 'restarting')),
    healthy_instances INTEGER NOT NULL,
    instances INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    active_operation TEXT
);
CREATE TABLE IF NOT EXISTS operations (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    service TEXT NOT NULL,
    tenant TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('running', 'completed', 'failed')),
    started_at REAL NOT NULL,
    ready_at REAL NOT NULL,
    idempotency_key TEXT,
    expires_at REAL
);
CREATE TABLE IF NOT EXISTS accounts (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    balance_cents INTEGER NOT NULL,
    version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS refunds (
    id TEXT PRIMARY KEY,
    account TEXT NOT NULL,
    tenant TEXT NOT NULL,
    amount_cents INTEGER NOT NULL,
    reason TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'issued' CHECK (status IN ('issued', 'reversed')),
    idempotency_key TEXT,
    reversal_key TEXT,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS effects (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    tool TEXT NOT NULL,
    idempotency_key TEXT,
    resource TEXT NOT NULL,
    detail TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS faults (
    tool TEXT NOT NULL,
    mode TEXT NOT NULL,
    remaining INTEGER NOT NULL,
    delay_seconds REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS cancellations (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    tool TEXT NOT NULL,
    idempotency_key TEXT,
    disposition TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS effects_by_key ON effects (idempotency_key);
CREATE INDEX IF NOT EXISTS refunds_by_key ON refunds (idempotency_key);
CREATE INDEX IF NOT EXISTS operations_by_key ON operations (idempotency_key);
"""


def resolve_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The database file: ``path`` if given, else env ``SOR_DB``, else ``./var/sor.sqlite3``."""
    return Path(path if path is not None else os.environ.get("SOR_DB", DEFAULT_DB))


def now() -> float:
    """Wall-clock seconds; one place so operation timing is easy to reason about."""
    return time.time()


def connect(path: str | os.PathLike[str] | None = None, *, readonly: bool = False) -> sqlite3.Connection:
    """Open a connection in autocommit mode (transactions are explicit).

    ``readonly`` opens with ``mode=ro`` so the connection physically cannot write: the reader
    identity must not be able to change the record even by a bug in this server.
    """
    db = resolve_path(path).resolve()
    if readonly:
        conn = sqlite3.connect(
            f"{db.as_uri()}?mode=ro", uri=True, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000
        )
        try:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except sqlite3.OperationalError:
            # On a read-only mount (a sandboxed reader) SQLite cannot create the WAL's -shm file.
            # With no -wal/-shm at all, no connection is open and every commit is in the main file:
            # read it as it stands. (With them present the normal open works.)
            wal, shm = Path(f"{db}-wal"), Path(f"{db}-shm")
            conn.close()
            if wal.exists() or shm.exists() or not db.exists():
                raise
            conn = sqlite3.connect(f"{db.as_uri()}?mode=ro&immutable=1", uri=True, isolation_level=None,
                                   timeout=BUSY_TIMEOUT_MS / 1000)
    else:
        db.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(db, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        conn.execute("PRAGMA journal_mode=WAL")
    conn.row_factory = sqlite3.Row
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    return conn


@contextmanager
def reading(path: str | os.PathLike[str] | None = None) -> Iterator[sqlite3.Connection]:
    """A read-only connection holding one snapshot for the duration of the block."""
    conn = connect(path, readonly=True)
    try:
        conn.execute("BEGIN")  # one consistent WAL snapshot across several SELECTs
        yield conn
        conn.execute("COMMIT")
    finally:
        conn.close()


@contextmanager
def writing(path: str | os.PathLike[str] | None = None) -> Iterator[sqlite3.Connection]:
    """A ``BEGIN IMMEDIATE`` transaction: committed on normal exit, rolled back on any exception."""
    conn = connect(path)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    finally:
        conn.close()


def init_db(path: str | os.PathLike[str] | None = None) -> Path:
    """Create the file (and its directory) and the schema; safe to call any number of times."""
    db = resolve_path(path)
    conn = connect(db)
    try:
        conn.executescript(SCHEMA)
        columns = {row["name"] for row in conn.execute("PRAGMA table_info(operations)")}
        if "expires_at" not in columns:  # a file made before operation records expired
            conn.execute("ALTER TABLE operations ADD COLUMN expires_at REAL")
    finally:
        conn.close()
    return db


def next_id(conn: sqlite3.Connection, table: str, prefix: str) -> str:
    """The next ``PREFIX-N`` id for ``table``; safe only inside a write transaction."""
    row = conn.execute(
        f"SELECT COALESCE(MAX(CAST(SUBSTR(id, ?) AS INTEGER)), 0) + 1 FROM {table} WHERE id LIKE ?",
        (len(prefix) + 2, f"{prefix}-%"),
    ).fetchone()
    return f"{prefix}-{row[0]}"
