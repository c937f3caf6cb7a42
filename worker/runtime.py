"""What one worker process holds across tasks: settings, one database connection, MCP sessions.

Everything is created lazily in the process that uses it (never inherited across fork).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import psycopg

from ledger.store import connect
from proofline.contracts import Contract, contract_for
from proofline.settings import ROOT, Settings, get_settings
from worker.mcp_client import McpSessions, sessions
from worker.servers import Server, server_named


@dataclass
class Runtime:
    settings: Settings
    pid: int

    @cached_property
    def mcp(self) -> McpSessions:
        return sessions(ROOT / "var")

    _conn: psycopg.Connection[dict[str, Any]] | None = None

    @property
    def conn(self) -> psycopg.Connection[dict[str, Any]]:
        """The process's connection; a broken one is replaced before the next task uses it."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = connect(
                self.settings.database_url,
                application_name=f"proofline-worker-{os.getpid()}",
                # A silent database must not hold a worker (and its locks) forever.
                keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=3,
                tcp_user_timeout=15000, connect_timeout=10,
                options="-c idle_in_transaction_session_timeout=30000",
            )
        return self._conn

    def reset_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
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
