"""Starting the audit system next to a system of record: its feed process, and over HTTP its server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from proofline_kit.audit import store
from proofline_kit.processes import start_process, wait_port_file


def prepare(audit_db: Path) -> None:
    """Create the audit store so a reader started before the first copy finds its schema."""
    store.init_db(audit_db).close()


def start_feed(sor_db: Path, audit_db: Path, env: dict[str, str], log: Path,
               processes: list[subprocess.Popen]) -> subprocess.Popen:
    """The feed (its own process): effects reach the audit store ``AUDIT_DELAY_MS`` after they happened."""
    argv = [sys.executable, "-m", "proofline_kit.audit", "feed", "--sor-db", str(sor_db), "--db", str(audit_db)]
    processes.append(start_process(argv, env, log))
    return processes[-1]


def start_http_server(audit_db: Path, env: dict[str, str], workdir: Path, processes: list[subprocess.Popen]) -> int:
    """The audit MCP server over HTTP on a port it picks itself; returns the port."""
    port_file = workdir / "ports" / "audit.port"
    argv = [sys.executable, "-m", "proofline_kit.audit", "serve", "--transport", "http", "--port", "0",
            "--port-file", str(port_file), "--db", str(audit_db)]
    processes.append(start_process(argv, env, workdir / "audit-http.log"))
    return wait_port_file(port_file, processes[-1])
