"""Execution leases: Postgres advisory locks on the action and on its target, plus a ``leases``
row that names the owner, carries a fencing token and is renewed by heartbeats.

Session-level advisory locks are held on the worker's own connection for the whole action, so a
crashed worker's locks vanish with its session. The row and its fencing token are what other
writers check: a write made under a token that is no longer current is refused. Lease expiry
never re-executes anything by itself; the next holder reconciles first (``worker/execute.py``).
All times come from the database clock.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from ledger import store
from ledger.store import Cursor
from proofline.errors import LeaseBusy
from worker import timer

log = logging.getLogger(__name__)

# Two-key locks would collide across namespaces; one 64-bit key per name keeps them apart.
LOCK_SQL = "pg_try_advisory_lock(hashtextextended(%s, 0))"
UNLOCK_SQL = "pg_advisory_unlock(hashtextextended(%s, 0))"


def action_lock_name(action_id: str) -> str:
    return f"proofline:action:{action_id}"


def target_lock_name(tenant: str, target_type: str, target_id: str) -> str:
    return f"proofline:target:{tenant}:{target_type}:{target_id}"


@dataclass
class Locks:
    """The two advisory locks this session holds for one action."""

    action: str
    target: str


def try_lock_and_read(
    conn: psycopg.Connection[dict[str, Any]], locks: Locks, extra_sql: str = "SELECT 1 AS one", params: tuple = (),
    *, hold: bool = False,
) -> dict[str, Any]:
    """Take both locks in one round trip, together with a read-only query the caller needs and the
    fencing token this holder will write under (``fencing_token``, drawn only when both locks were
    taken; a sequence draw writes nothing).

    ``hold``: the statement opens a transaction that stays open (``ledger.store.begin_with_read``),
    so that the claim finishes it and the stage commits once; session-level advisory locks are not
    transactional, so ending it early (any other write does) never releases them.

    Raises :class:`LeaseBusy` (and holds nothing, no transaction either) when either lock is taken
    by a live session.
    """
    sql = f"""SELECT locked.*, CASE WHEN got_action AND got_target THEN nextval('lease_fencing_seq') END
                     AS fencing_token, extra.*
              FROM (SELECT {LOCK_SQL} AS got_action, {LOCK_SQL} AS got_target OFFSET 0) AS locked,
                   ({extra_sql}) AS extra"""
    if hold:
        row = store.begin_with_read(conn, sql, (locks.action, locks.target, *params))
    else:
        with conn.cursor() as cur:
            cur.execute(sql, (locks.action, locks.target, *params))
            row = cur.fetchone()
    assert row is not None
    if row["got_action"] and row["got_target"]:
        return row
    store.end_held_read(conn)
    unlock(conn, locks, action=row["got_action"], target=row["got_target"])
    which = "action" if not row["got_action"] else "target"
    raise LeaseBusy(f"{which} lock is held by another live worker", which=which)


def unlock(conn: psycopg.Connection[dict[str, Any]], locks: Locks, *, action: bool = True, target: bool = True) -> None:
    names = ([locks.action] if action else []) + ([locks.target] if target else [])
    if not names or conn.closed:
        return
    with conn.cursor() as cur:
        cur.execute("SELECT " + ", ".join([UNLOCK_SQL] * len(names)), names)


def unlock_sql(locks: Locks) -> tuple[str, tuple[str, str]]:
    """The statement that releases both locks; run it last in the final transaction."""
    return f"SELECT {UNLOCK_SQL}, {UNLOCK_SQL}", (locks.target, locks.action)


def lease_arguments(action_id: str, target_key: str, worker_id: str, ttl_seconds: float, locks: Locks,
                    token: int | None) -> dict[str, Any]:
    """The arguments of ``proofline_take_lease`` (migration 0012), named for ``ledger.store``."""
    return {"action": action_id, "target": target_key, "lock_action": locks.action, "lock_target": locks.target,
            "host": socket.gethostname(), "pid": os.getpid(), "worker": worker_id, "token": token, "ttl": ttl_seconds}


def write_lease_txn(cur: Cursor, action_id: str, target_key: str, worker_id: str, ttl_seconds: float,
                    locks: Locks, token: int | None = None) -> int:
    """Record (or take over) the lease row under ``token`` (default: a new one); returns it. The
    database first checks that this session still holds both locks: a session that ended (or was
    replaced) since they were taken holds nothing, and another worker may already be advancing the
    action (``LeaseBusy``, ``which="lost"``). A lease row never takes an older token."""
    try:
        cur.execute(
            """SELECT proofline_take_lease(%(action)s, %(target)s, %(lock_action)s, %(lock_target)s, %(host)s,
                                           %(pid)s, %(worker)s, %(token)s, %(ttl)s) AS fencing_token""",
            lease_arguments(action_id, target_key, worker_id, ttl_seconds, locks, token))
        row = cur.fetchone()
    except psycopg.Error as exc:
        if exc.sqlstate == "PL103":
            raise LeaseBusy(exc.diag.message_primary or str(exc), which="lost") from exc
        raise
    assert row is not None
    return int(row["fencing_token"])


def release_lease_txn(cur: Cursor, action_id: str, fencing_token: int) -> None:
    """Mark the lease released (only under its own token); nothing is fetched, so it pipelines."""
    cur.execute(
        "UPDATE leases SET released_at = clock_timestamp() WHERE action_id = %s AND fencing_token = %s "
        "AND released_at IS NULL",
        (action_id, fencing_token),
    )


class SessionKeeper:
    """Keeps the lock-holding session busy from the moment the locks are taken until the action
    lets them go, so that Postgres's ``idle_session_timeout`` (the lease TTL) only ends the session
    of a worker that stopped running, never one that waits on a slow MCP server before the call
    (the call itself also has its :class:`Heartbeat`). Runs on the process's timer thread
    (``worker/timer.py``): on the fast path it never fires, and costs no thread of its own."""

    def __init__(self, conn: psycopg.Connection, interval: float, touch=lambda: None) -> None:
        self.conn, self.interval, self.touch = conn, interval, touch
        self._job: timer.Job | None = None

    def start(self) -> SessionKeeper:
        self._job = timer.every(self.interval, self._keep, name="lock-session-keeper")
        return self

    def stop(self) -> None:
        if self._job is not None:
            self._job.stop(timeout=self.interval + 5)

    def _keep(self) -> bool:
        try:
            if self.conn.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF:
                # A stage's pipelined flight is in progress otherwise: the session is busy, and a
                # statement from this thread would join that flight.
                with self.conn.cursor() as cur:
                    cur.execute("SELECT 1")
            self.touch()
        except psycopg.Error:
            # The session is gone, and its locks with it: the claim transaction's lock check
            # (write_lease_txn) refuses to go on.
            log.warning("lock session lost", extra={"event": "lock_session_lost"})
            return False
        return True


class Heartbeat:
    """Renews the lease row while a tool call runs, on the worker's own connection.

    Using the lock-holding connection matters: it keeps that session busy, so Postgres's
    ``idle_session_timeout`` only ends the session (and frees the locks) of a worker that has stopped
    running. :meth:`valid` lets the caller refuse to send a request once the lease may have lapsed,
    judged on the local monotonic clock so a worker that was frozen notices on waking.
    """

    def __init__(self, conn: psycopg.Connection, action_id: str, fencing_token: int, ttl: float, interval: float,
                 touch=lambda: None, on_cancel=lambda: None) -> None:
        self.conn, self.action_id, self.token, self.ttl, self.interval = conn, action_id, fencing_token, ttl, interval
        self.touch = touch
        #: Called once when an operator's cancellation is seen on a heartbeat.
        self.on_cancel = on_cancel
        self.cancel_seen = False
        self.lost = threading.Event()
        self.renewed_at = time.monotonic()
        self._job: timer.Job | None = None

    def __enter__(self) -> Heartbeat:
        self._job = timer.every(self.interval, self._renew, name="lease-heartbeat")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._job is not None:
            self._job.stop(timeout=self.interval + 5)

    def valid(self) -> bool:
        """True while the lease is certainly ours: renewed within the TTL, never reported lost."""
        return not self.lost.is_set() and time.monotonic() - self.renewed_at < self.ttl * 0.8

    def _renew(self) -> bool:
        before = time.monotonic()
        try:
            with self.conn.cursor() as cur:
                cur.execute(
                    "UPDATE leases SET heartbeat_at = clock_timestamp(), "
                    "expires_at = clock_timestamp() + make_interval(secs => %s) "
                    "WHERE action_id = %s AND fencing_token = %s AND released_at IS NULL RETURNING "
                    "(SELECT cancel_requested_at IS NOT NULL FROM actions WHERE action_id = %s) AS cancel",
                    (self.ttl, self.action_id, self.token, self.action_id),
                )
                row = cur.fetchone()
        except psycopg.Error:
            log.exception("heartbeat failed", extra={"action_id": self.action_id, "event": "heartbeat_failed"})
            self.lost.set()
            return False
        self.touch()
        if row is not None and row["cancel"] and not self.cancel_seen:
            self.cancel_seen = True
            self.on_cancel()
        if row is None:
            log.warning("lease lost", extra={"action_id": self.action_id, "event": "lease_lost"})
            self.lost.set()
            return False
        self.renewed_at = before
        return True
