"""``proofline doctor``: is this deployment able to run actions, and if not, what to do about it.

One line per check (``ok`` or ``FAIL``, what was found, and for a failure how to fix it), exit 1 if
any check failed, ``--json`` for machines. Every check runs even when an earlier one failed, so
one run lists everything that is wrong. Checks: the database, its migrations, the broker, the
reconciler's heartbeat, the keys this process role needs, the contracts, the servers file and what
its sandboxes need on this host.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from proofline.settings import Settings, get_settings, reveal

#: The connect timeout of each service check, in seconds: a doctor must answer, not hang.
CONNECT_TIMEOUT = 5
#: A heartbeat older than this many reconcile intervals means no reconciler is sweeping.
HEARTBEAT_INTERVALS = 3
#: ... but never less than this, so a short interval does not make a healthy deployment look dead.
HEARTBEAT_FLOOR_SECONDS = 30.0


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    #: For a failure: what to do about it.
    fix: str = ""

    def line(self) -> str:
        text = f"{'ok' if self.ok else 'FAIL':<5} {self.name:<11} {self.detail}"
        return text if self.ok else f"{text}; fix: {self.fix}"


class Failed(Exception):
    """A check's failure: the detail and the fix."""

    def __init__(self, detail: str, fix: str) -> None:
        super().__init__(detail)
        self.detail, self.fix = detail, fix


def _database_url(settings: Settings) -> str:
    return reveal(settings.reader_database_url) or reveal(settings.database_url) or ""


def _connect(settings: Settings) -> Any:
    from ledger.store import connect

    try:
        return connect(_database_url(settings), connect_timeout=CONNECT_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - any failure to connect is this check's answer
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Failed(f"cannot connect: {first}",
                     "start Postgres or set PROOFLINE_DATABASE_URL (and PROOFLINE_READER_DATABASE_URL)") from None


def check_database(settings: Settings) -> str:
    with _connect(settings) as conn, conn.cursor() as cur:
        cur.execute("SELECT current_user AS who, current_database() AS db")
        row = cur.fetchone()
    return f"connected to {row['db']} as {row['who']}"


def check_migrations(settings: Settings) -> str:
    from alembic.script import ScriptDirectory

    from ledger.migrate import HERE

    head = ScriptDirectory(str(HERE / "migrations")).get_current_head()
    with _connect(settings) as conn, conn.cursor() as cur:
        cur.execute("SELECT to_regclass('alembic_version') IS NOT NULL AS present, CASE WHEN "
                    "to_regclass('alembic_version') IS NULL THEN false "
                    "ELSE has_table_privilege('alembic_version', 'SELECT') END AS readable")
        found = cur.fetchone()
        current = None
        if found["present"] and not found["readable"]:
            raise Failed("this role may not read alembic_version (the database predates revision 0009)",
                         "run `proofline migrate`")
        if found["present"]:
            cur.execute("SELECT version_num FROM alembic_version")
            row = cur.fetchone()
            current = row["version_num"] if row else None
    if current != head:
        raise Failed(f"database at revision {current or 'none'}, code at {head}",
                     "run `proofline migrate` (with PROOFLINE_ADMIN_DATABASE_URL set to a role that may)")
    return f"at head ({head})"


def check_broker(settings: Settings) -> str:
    from kombu import Connection

    url = reveal(settings.broker_url) or ""
    try:
        with Connection(url, connect_timeout=CONNECT_TIMEOUT) as conn:
            conn.ensure_connection(max_retries=1, timeout=CONNECT_TIMEOUT)
            where = conn.as_uri()
    except Exception as exc:  # noqa: BLE001 - any failure to connect is this check's answer
        raise Failed(f"cannot reach the broker: {type(exc).__name__}: {str(exc)[:200]}",
                     "start the broker or set PROOFLINE_BROKER_URL") from None
    return f"reachable at {where}"


def check_reconciler(settings: Settings) -> str:
    from ledger.heartbeat import latest

    fix = ("run `proofline beat` (the reconciler's timer) and a worker that consumes the reconcile queue "
           "(`proofline worker --role recovery`)")
    with _connect(settings) as conn, conn.cursor() as cur:
        beat = latest(cur)
    if beat is None:
        raise Failed("no reconciler sweep was ever recorded: lost messages are never re-driven", fix)
    limit = max(HEARTBEAT_INTERVALS * settings.reconcile_interval_seconds, HEARTBEAT_FLOOR_SECONDS)
    if beat.age_seconds > limit:
        raise Failed(f"the last sweep ({beat.sweeper}) was {beat.age_seconds:.0f} s ago (more than {limit:.0f} s)",
                     fix)
    return f"last sweep {beat.age_seconds:.0f} s ago by {beat.sweeper}"


def check_keys(settings: Settings, role: str) -> str:
    from proofline.errors import ProoflineError
    from proofline.keys import check_process_keys

    fix = "create them with `proofline keys generate --dir DIR` and set PROOFLINE_KEYS_DIR=DIR"
    if settings.keys_dir is None and settings.keyring_file is None:
        raise Failed("no keys configured (PROOFLINE_KEYS_DIR is not set)", fix)
    try:
        warnings = check_process_keys(settings, role)
    except (ProoflineError, OSError) as exc:
        raise Failed(f"keys for a {role} process: {str(exc)[:300]}", fix) from None
    where = settings.keys_dir or settings.keyring_file
    return f"a {role} process's keys in {where} load" + (f" ({'; '.join(warnings)})" if warnings else "")


def check_contracts(settings: Settings) -> str:
    from proofline.contracts import scan_contracts

    directory = Path(settings.contracts_dir)
    fix = "fix or remove the file (`proofline contracts check` shows each), or set PROOFLINE_CONTRACTS_DIR"
    if not directory.is_dir():
        raise Failed(f"{directory} is not a directory", "set PROOFLINE_CONTRACTS_DIR to the contracts folder")
    loaded = scan_contracts(directory)
    if loaded.broken:
        named = ", ".join(f"{name}: {reason}" for name, reason in sorted(loaded.broken.values()))
        raise Failed(f"{len(loaded.broken)} refused in {directory}: {named[:400]}", fix)
    if not loaded.contracts:
        raise Failed(f"no contracts in {directory}", "set PROOFLINE_CONTRACTS_DIR to the contracts folder")
    return f"{len(loaded.contracts)} loaded from {directory}"


def check_servers(settings: Settings) -> str:
    from proofline.errors import ProoflineError
    from worker.servers import check_sandbox_policy, load_servers

    path = Path(settings.servers_file)
    try:
        servers = load_servers(path)
        unsandboxed = check_sandbox_policy(path, settings.environment)
    except (ProoflineError, OSError, ValueError) as exc:
        raise Failed(f"{path}: {str(exc)[:300]}", "fix the servers file, or set PROOFLINE_SERVERS_FILE") from None
    sandboxed = [f"{s.name}/{role}" for s in servers.values() for role, e in (("write", s.write), ("read", s.read))
                 if e.transport == "stdio" and e.sandbox.enabled]
    if sandboxed and shutil.which("bwrap") is None:
        raise Failed(f"{', '.join(sandboxed)} run sandboxed but bubblewrap (bwrap) is not on PATH",
                     "install bubblewrap (Debian: apt-get install bubblewrap)")
    unaudited = [name for name, e in (
        (f"{s.name}/{role}", e) for s in servers.values() for role, e in (("write", s.write), ("read", s.read)))
        if e.transport == "stdio" and e.sandbox.enabled and e.sandbox.audit is not False]
    if unaudited and shutil.which("strace") is None:
        raise Failed(f"{', '.join(unaudited)} audit denied paths but strace is not on PATH (nothing is audited)",
                     "install strace (Debian: apt-get install strace), or set sandbox: {audit: false, "
                     "audit_reason: ...}")
    base = settings.servers_base_dir
    missing = sorted({p for s in servers.values() for e in (s.write, s.read) if e.transport == "stdio"
                      for p in (*e.sandbox.ro_paths, *e.sandbox.rw_paths)
                      if not (Path(p) if Path(p).is_absolute() else base / p).exists()})
    if missing:
        raise Failed(f"sandbox paths missing under {base}: {', '.join(missing)}",
                     "create them, or fix ro_paths/rw_paths in the servers file")
    note = f"; unsandboxed: {', '.join(f'{k} ({v})' for k, v in unsandboxed.items())}" if unsandboxed else ""
    return f"{len(servers)} server(s) in {path}" + (", bwrap found" if sandboxed else "") + (", strace found" if unaudited else "") + note


#: Checks that read the database: not run (and failed) when it cannot be reached.
NEEDS_DATABASE = ("migrations", "reconciler")


def run_checks(settings: Settings, role: str) -> list[Check]:
    checks: list[tuple[str, Callable[[], str]]] = [
        ("database", lambda: check_database(settings)),
        ("migrations", lambda: check_migrations(settings)),
        ("broker", lambda: check_broker(settings)),
        ("reconciler", lambda: check_reconciler(settings)),
        ("keys", lambda: check_keys(settings, role)),
        ("contracts", lambda: check_contracts(settings)),
        ("servers", lambda: check_servers(settings)),
    ]
    results: list[Check] = []
    for name, check in checks:
        if name in NEEDS_DATABASE and not results[0].ok:
            results.append(Check(name, False, "not checked: the database is unreachable",
                                 "fix the database check first"))
            continue
        try:
            results.append(Check(name, True, check()))
        except Failed as exc:
            results.append(Check(name, False, exc.detail, exc.fix))
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failed check, not a traceback
            results.append(Check(name, False, f"{type(exc).__name__}: {str(exc).strip()[:300]}",
                                 "unexpected: correct the setting it names, or report it"))
    return results


@click.command()
@click.option("--role", type=click.Choice(["execute", "recovery", "all", "controller"]), default="all",
              show_default=True, help="which process's keys to check")
@click.option("--json", "as_json", is_flag=True, help="one JSON document instead of lines")
def doctor(role: str, as_json: bool) -> None:
    """Check the database and its migrations, the broker, the reconciler's heartbeat, keys, contracts
    and servers (with their sandbox); one line each, exit 1 if any failed."""
    try:
        settings = get_settings()
    except Exception as exc:  # noqa: BLE001 - invalid settings are the first thing to report
        raise click.ClickException(f"settings: {str(exc).splitlines()[0]}") from None
    results = run_checks(settings, role)
    if as_json:
        click.echo(json.dumps({"ok": all(r.ok for r in results), "checks": [asdict(r) for r in results]}, indent=2))
    else:
        for result in results:
            click.echo(result.line())
    sys.exit(0 if all(r.ok for r in results) else 1)
