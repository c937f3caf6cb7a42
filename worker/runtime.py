"""What one worker process holds across tasks: settings, one database connection, MCP sessions.

Everything is created lazily in the process that uses it (never inherited across fork).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import psycopg

from ledger import seal
from ledger.store import connect
from proofline.contracts import Contract, contract_for
from proofline.keys import KeyRole, SigningKey, load_signing_key
from proofline.settings import Settings, get_settings, reveal
from worker.mcp_client import McpSessions, sessions
from worker.servers import Server, server_named


@dataclass
class Runtime:
    settings: Settings
    pid: int

    @cached_property
    def mcp(self) -> McpSessions:
        # Relative paths in the servers file: see Settings.servers_base_dir.
        return sessions(self.settings.servers_base_dir, self.settings.environment,
                        self.settings.mcp_connect_timeout_seconds)

    @property
    def seal_key(self) -> seal.SealKey:
        """The key stored signed messages are sealed with (``Settings.seal_key_file``)."""
        return seal.sealer_for(self.settings)

    @property
    def worker_key(self) -> SigningKey:
        """This worker's key (``Settings.worker_key_file``): it signs the evidence the worker records.
        Re-read when the file changes, so a replaced key signs from the next action on."""
        return load_signing_key(self.settings.worker_key_file, KeyRole.worker, self.settings.environment)

    _conn: psycopg.Connection[dict[str, Any]] | None = None
    _last_used: float = 0.0
    #: Set while this process holds an action's advisory locks on ``_conn``: the connection is then
    #: never replaced (that would drop the locks while the action goes on).
    holding_locks: bool = False

    @property
    def idle_timeout(self) -> float:
        """Postgres ends this connection's session after this long without a statement.

        That is what frees the advisory locks of a worker that is frozen (SIGSTOP, a stuck VM): a
        live worker's heartbeat keeps the session busy while it holds a lease, a frozen one's cannot.
        """
        return self.settings.lease_ttl_seconds

    @property
    def conn(self) -> psycopg.Connection[dict[str, Any]]:
        """The process's connection. A broken one, or one the server has probably ended for being
        idle, is replaced before use; while it holds an action's locks it is never replaced for
        having been idle (the session keeper and the heartbeat keep it in use)."""
        now = time.monotonic()
        stale = self._conn is not None and not self.holding_locks and now - self._last_used > self.idle_timeout * 0.8
        if self._conn is None or self._conn.closed or self._conn.broken or stale:
            self.reset_connection()
            self._conn = connect(
                reveal(self.settings.database_url),
                application_name=f"proofline-worker-{os.getpid()}",
                # A silent database must not hold a worker (and its locks) forever.
                keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=3,
                tcp_user_timeout=15000, connect_timeout=10,
                options=(f"-c idle_in_transaction_session_timeout={int(self.idle_timeout * 1000)} "
                         f"-c idle_session_timeout={int(self.idle_timeout * 1000)}"),
            )
        self._last_used = now
        return self._conn

    def touch(self) -> None:
        """Record that the connection was just used (by the heartbeat thread)."""
        self._last_used = time.monotonic()

    def reset_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
            finally:
                self._conn = None

    def contract(self, action_type: str) -> Contract:
        return contract_for(Path(self.settings.contracts_dir), action_type)

    def server(self, name: str) -> Server:
        return server_named(Path(self.settings.servers_file), name)


_runtime: Runtime | None = None


def runtime() -> Runtime:
    global _runtime
    if _runtime is None or _runtime.pid != os.getpid():
        _runtime = Runtime(settings=get_settings(), pid=os.getpid())
    return _runtime
