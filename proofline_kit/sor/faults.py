"""Deterministic fault switches stored in the ``faults`` table.

Tests arm a fault for a tool name; the server consumes one "shot" per call. Living in the shared
SQLite file (not in process memory) lets a test arm a fault in a server subprocess it started.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass

from proofline_kit.sor.db import connect, writing

#: Every mode the server understands (``unavailable`` only for the read-outage switch).
MODES = frozenset(
    {
        "delay",
        "drop_response",
        "fail_before_commit",
        "fail_after_commit",
        "lie",
        "lie_consistently",
        "progress_flood",
        "huge_result",
        "ignore_cancel",
        "unavailable",
        "read_lag",
        "operation_ttl",
        "list_changed",
        "contract_variant",
        "deep_nesting",
        "apply_twice",
        "server_requests",
        "ask_roots",
        "ask_elicitation",
    }
)
#: Tool name of the switch that takes every read tool down.
READ_OUTAGE = "*read*"
#: Tool name prefix of the switch that makes one identity's reads lag behind the writer (its
#: ``delay_seconds`` holds the wall-clock time the replica shows).
READ_LAG = "*lag*"
#: Tool name of the switch that gives the next operation record a short time to live.
OPERATION_TTL = "*operation_ttl*"
#: Tool name of the switch that sets the tool-contract variant a server starts with (its
#: ``delay_seconds`` holds the variant number; ``SOR_CONTRACT_VARIANT`` in the environment wins).
CONTRACT_VARIANT = "*contract_variant*"
#: How long ``drop_response`` sleeps when no delay is given: far past any client timeout.
DROP_RESPONSE_DEFAULT_SECONDS = 3600.0


@dataclass(frozen=True)
class Fault:
    """One armed fault as taken for a single call."""

    tool: str
    mode: str
    delay_seconds: float


def set_fault(
    path: str | os.PathLike[str] | None, tool: str, mode: str, remaining: int = 1, delay_seconds: float = 0.0
) -> None:
    """Arm ``mode`` for ``tool`` for ``remaining`` calls (``-1`` = forever), replacing any fault on it."""
    if mode not in MODES:
        raise ValueError(f"unknown fault mode {mode!r}")
    with writing(path) as conn:
        conn.execute("DELETE FROM faults WHERE tool = ?", (tool,))
        conn.execute(
            "INSERT INTO faults (tool, mode, remaining, delay_seconds) VALUES (?, ?, ?, ?)",
            (tool, mode, remaining, delay_seconds),
        )


def clear_faults(path: str | os.PathLike[str] | None, tool: str | None = None) -> None:
    """Disarm every fault, or only the one on ``tool``."""
    with writing(path) as conn:
        if tool is None:
            conn.execute("DELETE FROM faults")
        else:
            conn.execute("DELETE FROM faults WHERE tool = ?", (tool,))


def read_outage_name(role: str | None = None) -> str:
    """The fault switch name of a read outage, for every identity or for one role only."""
    return READ_OUTAGE if role is None else f"{READ_OUTAGE}:{role}"


def set_read_outage(path: str | os.PathLike[str] | None, on: bool = True, role: str | None = None) -> None:
    """Make every read tool answer ``error_class: unavailable`` (or end the outage).

    With ``role="reader"`` only the read-only identity (the verification path) is cut off, while
    the writer's own reads (preconditions) keep working, as when a monitoring API is down.
    """
    if on:
        set_fault(path, read_outage_name(role), "unavailable", remaining=-1)
    else:
        clear_faults(path, read_outage_name(role))


def set_replica_position(path: str | os.PathLike[str] | None, at: float | None, role: str = "reader") -> None:
    """Make ``role``'s reads show the record as it stood at wall-clock time ``at``, as a replica whose
    replication stopped there (tools that can read as of a past time: ``get_service``); ``None``
    lets it catch up. Its lag grows until then, so a test decides by a condition when it ends."""
    name = f"{READ_LAG}:{role}"
    if at is None:
        clear_faults(path, name)
    else:
        set_fault(path, name, "read_lag", remaining=-1, delay_seconds=at)


def set_operation_ttl(path: str | os.PathLike[str] | None, seconds: float, remaining: int = 1) -> None:
    """Give the next ``remaining`` operation records a time to live of ``seconds`` (from their start)."""
    set_fault(path, OPERATION_TTL, "operation_ttl", remaining=remaining, delay_seconds=seconds)


def set_contract_variant(path: str | os.PathLike[str] | None, variant: int | None) -> None:
    """Servers started from now on publish tool-contract ``variant`` (None: the default, 1). A
    running server keeps its tools: this is how a test restarts a stdio server, which the worker
    spawns itself, with a changed schema."""
    if variant is None:
        clear_faults(path, CONTRACT_VARIANT)
    else:
        set_fault(path, CONTRACT_VARIANT, "contract_variant", remaining=-1, delay_seconds=float(variant))


def contract_variant(path: str | os.PathLike[str] | None) -> str | None:
    """The variant set by :func:`set_contract_variant`, if any."""
    fault = take_fault(path, CONTRACT_VARIANT, readonly=True)
    return None if fault is None else str(int(fault.delay_seconds))


def _active(conn: sqlite3.Connection, tool: str) -> sqlite3.Row | None:
    return conn.execute(
        "SELECT rowid, tool, mode, remaining, delay_seconds FROM faults"
        " WHERE tool = ? AND remaining <> 0 ORDER BY rowid LIMIT 1",
        (tool,),
    ).fetchone()


def take_fault(path: str | os.PathLike[str] | None, tool: str, *, readonly: bool = False) -> Fault | None:
    """Consume one shot of the fault armed for ``tool``, if any, and return it.

    The common case (nothing armed, or armed forever) is answered from a read-only peek so that
    read tools do not queue on the write lock. A read-only connection cannot count down, so with
    ``readonly`` a finite fault is only peeked at and stays armed (use ``remaining=-1`` there).
    """
    conn = connect(path, readonly=True)
    try:
        row = _active(conn, tool)
    finally:
        conn.close()
    if row is not None and row["remaining"] > 0 and not readonly:
        with writing(path) as conn:
            row = _active(conn, tool)  # re-read under the lock: another process may have spent it
            if row is not None and row["remaining"] > 0:
                conn.execute("UPDATE faults SET remaining = remaining - 1 WHERE rowid = ?", (row["rowid"],))
    if row is None:
        return None
    return Fault(tool=row["tool"], mode=row["mode"], delay_seconds=float(row["delay_seconds"] or 0.0))


def list_faults(path: str | os.PathLike[str] | None = None) -> list[dict[str, object]]:
    """Every fault row, armed or spent, for assertions and debugging."""
    conn = connect(path, readonly=True)
    try:
        rows = conn.execute(
            "SELECT tool, mode, remaining, delay_seconds FROM faults ORDER BY rowid"
        ).fetchall()
    finally:
        conn.close()
    return [dict(r) for r in rows]
