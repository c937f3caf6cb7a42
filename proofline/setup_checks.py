"""The checks of a deployment's setup that ``proofline doctor`` lists and ``proofline worker`` runs
before it consumes, so the two cannot disagree.

Each check returns what it found or raises :class:`Failed` with the detail and the fix. ``doctor``
runs them all and prints one line each; a worker runs :func:`worker_checks` in order and refuses to
start on the first failure, one line, exit 3 (``configuration_error``): see :func:`refuse_bad_setup`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from proofline.errors import ConfigurationError, ProoflineError
from proofline.production_checks import check_broker_auth, check_database_auth, check_key_files
from proofline.settings import Environment, Settings, reveal

#: The connect timeout of each service check, in seconds: a check must answer, not hang.
CONNECT_TIMEOUT = 5
#: A heartbeat older than this many reconcile intervals means no reconciler is sweeping.
HEARTBEAT_INTERVALS = 3
#: ... but never less than this, so a short interval does not make a healthy deployment look dead.
HEARTBEAT_FLOOR_SECONDS = 30.0
#: Broker schemes that take a password in production, with the form of a URL that carries one.
CREDENTIALED_BROKERS = {"redis": "redis://:PASSWORD@HOST:6379/0", "rediss": "rediss://:PASSWORD@HOST:6380/0",
                        "amqp": "amqp://USER:PASSWORD@HOST:5672//", "amqps": "amqps://USER:PASSWORD@HOST:5671//"}


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


def check_environment(settings: Settings) -> str:
    """In production, two rules more: not as root, and a broker URL with credentials (what the host
    and its services allow is checked by ``proofline/production_checks.py``)."""
    env = settings.environment
    if env != Environment.production:
        return f"{env.value}: the production rules are off (development keys, unsandboxed servers, one process " \
               "with every role are accepted)"
    # A RabbitMQ cluster's URL is a ``;``-separated list of its nodes: every one needs the password.
    for url in (urlsplit(part.strip()) for part in (reveal(settings.broker_url) or "").split(";")):
        if url.scheme not in CREDENTIALED_BROKERS or url.password:
            continue
        raise Failed(f"PROOFLINE_BROKER_URL ({url.scheme}://{url.hostname or ''}) carries no password: anyone who "
                     "reaches the broker can send tasks to the workers",
                     f"give the broker a password and put it in the URL ({CREDENTIALED_BROKERS[url.scheme]})")
    if os.geteuid() == 0:
        raise Failed("this process runs as root", "run Proofline as an unprivileged user (its own system user)")
    return f"production: not root (uid {os.geteuid()}), the broker URL carries credentials"


def _database_url(settings: Settings, own: bool) -> str:
    if own:
        return reveal(settings.database_url) or ""
    return reveal(settings.reader_database_url) or reveal(settings.database_url) or ""


def _connect(settings: Settings, own: bool = False) -> Any:
    """A connection for a check: as the reader when one is configured (doctor), or as this process's
    own role (``own``: the worker checks the URL it will run with)."""
    from ledger.store import connect

    names = "PROOFLINE_DATABASE_URL" if own else "PROOFLINE_DATABASE_URL (and PROOFLINE_READER_DATABASE_URL)"
    try:
        return connect(_database_url(settings, own), connect_timeout=CONNECT_TIMEOUT)
    except ConfigurationError as exc:
        raise Failed(exc.detail, f"set {names} to postgresql://USER@HOST:PORT/DATABASE") from None
    except Exception as exc:  # noqa: BLE001 - any failure to connect is this check's answer
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Failed(f"cannot connect: {first}", f"start Postgres or set {names}") from None


def check_database(settings: Settings, own: bool = False) -> str:
    with _connect(settings, own) as conn, conn.cursor() as cur:
        cur.execute("SELECT current_user AS who, current_database() AS db")
        row = cur.fetchone()
    return f"connected to {row['db']} as {row['who']}"


def check_migrations(settings: Settings, own: bool = False) -> str:
    from alembic.script import ScriptDirectory

    from ledger.migrate import HERE

    head = ScriptDirectory(str(HERE / "migrations")).get_current_head()
    with _connect(settings, own) as conn, conn.cursor() as cur:
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

    fix = ("create them with `proofline keys generate --dir DIR` (no --development in production) and set "
           "PROOFLINE_KEYS_DIR=DIR, or run the process role the message names")
    if settings.keys_dir is None and settings.keyring_file is None:
        raise Failed("no keys configured (PROOFLINE_KEYS_DIR is not set)", fix)
    try:
        warnings = check_process_keys(settings, role)
    except (ProoflineError, OSError) as exc:
        raise Failed(f"keys for a {role} process: {str(exc)[:300]}", fix) from None
    where = settings.keys_dir or settings.keyring_file
    return f"a {role} process's keys in {where} load" + (f" ({'; '.join(warnings)})" if warnings else "")


def check_authority(settings: Settings) -> str:
    """The signed authority policy loads and an active approver key signed it; in production one is
    required (without it every action would be refused as ``authority_policy_invalid``)."""
    from proofline.authority import policy_in_force

    fix = ("write the policy YAML, sign it with an approver key (`proofline authority sign POLICY --key KEY --out "
           "FILE`) and set PROOFLINE_AUTHORITY_FILE=FILE")
    try:
        loaded = policy_in_force(settings)
    except ProoflineError as exc:
        raise Failed(str(exc.detail)[:300], fix) from None
    if loaded is None:
        return "no authority policy: the controller's approval is the authority (mode unmanaged, development only)"
    modes = ", ".join(f"{name} {rule.mode.value}" for name, rule in sorted(loaded.policy.action_types.items()))
    return (f"policy version {loaded.policy.version} ({loaded.hash[:12]}) signed by {loaded.signed_by}: default "
            f"{loaded.policy.default_mode.value}" + (f"; {modes}" if modes else ""))


def check_contracts(settings: Settings, warnings: list[str] | None = None) -> str:
    """The contracts folder exists and its contracts load. With ``warnings`` (a worker), a refused
    file is a warning, not a failure: a broken contract refuses only its own action type (each of
    its actions is refused and recorded as ``contract_invalid``), never the others'."""
    from proofline.contracts import scan_contracts

    directory = Path(settings.contracts_dir)
    fix = "fix or remove the file (`proofline contracts check` shows each), or set PROOFLINE_CONTRACTS_DIR"
    if not directory.is_dir():
        raise Failed(f"{directory} is not a directory", "set PROOFLINE_CONTRACTS_DIR to the contracts folder")
    loaded = scan_contracts(directory)
    if loaded.broken:
        named = ", ".join(f"{name}: {reason}" for name, reason in sorted(loaded.broken.values()))
        if warnings is None:
            raise Failed(f"{len(loaded.broken)} refused in {directory}: {named[:400]}", fix)
        warnings.append(f"contracts: {len(loaded.broken)} refused in {directory} (their action types are refused "
                        f"and recorded): {named[:300]}")
    if not loaded.contracts:
        raise Failed(f"no contracts in {directory}", "set PROOFLINE_CONTRACTS_DIR to the contracts folder")
    return f"{len(loaded.contracts)} loaded from {directory}"


def check_evidence_capture(settings: Settings, warnings: list[str] | None = None) -> str:
    """Every contract whose ``evidence_capture`` policy captures has an auditor public key to seal
    to. Without one its actions are refused before any call (``evidence_capture_unavailable``);
    with ``warnings`` (a worker) that is a warning, since the other action types still run."""
    from proofline.auditor_keys import load_public, public_path
    from proofline.contracts import scan_contracts

    capturing = sorted(t for t, c in scan_contracts(Path(settings.contracts_dir)).contracts.items()
                       if c.evidence_capture.enabled)
    if not capturing:
        return "no contract captures evidence"
    try:
        key = load_public(settings)
    except ProoflineError as exc:
        detail = f"{', '.join(capturing)} capture evidence but {exc.detail}"
        if warnings is None:
            raise Failed(detail[:400], "make the auditor's pair (`proofline keys add-auditor --out AUDITOR_DIR/"
                         "auditor.key --public auditor.pub`) and set PROOFLINE_AUDITOR_PUBLIC_KEY_FILE") from None
        warnings.append(f"evidence capture: {detail[:300]} (their actions are refused before any call)")
        return detail
    return f"{', '.join(capturing)} capture evidence, sealed to auditor key {key.key_id} ({public_path(settings)})"


def check_servers(settings: Settings) -> str:
    """The servers file loads, the sandbox rules of this environment hold, bubblewrap can start a
    sandbox here (when a server runs in one) and every sandbox path exists."""
    from worker.sandbox import strace_available
    from worker.sandbox_probe import bwrap_problem
    from worker.servers import check_sandbox_policy, load_servers, sandboxed_identities

    path = Path(settings.servers_file)
    fix = f"correct {path}, or set PROOFLINE_SERVERS_FILE"
    try:
        servers = load_servers(path)
        unsandboxed = check_sandbox_policy(path, settings.environment)
    except ProoflineError as exc:
        raise Failed(exc.detail[:400], fix) from None
    except OSError as exc:
        raise Failed(f"{path} cannot be read: {exc.strerror or exc}", fix) from None
    sandboxed = sandboxed_identities(path)
    problem = bwrap_problem() if sandboxed else None
    if problem:
        raise Failed(f"{path}: {', '.join(sandboxed)} run sandboxed but {problem}",
                     "install bubblewrap (Debian: apt-get install bubblewrap) on the PATH of this process, or set "
                     "sandbox: {enabled: false, reason: \"...\"} for those servers")
    base = settings.servers_base_dir
    missing = sorted({p for s in servers.values() for e in (s.write, s.read) if e.transport == "stdio"
                      for p in (*e.sandbox.ro_paths, *e.sandbox.rw_paths)
                      if not (Path(p) if Path(p).is_absolute() else base / p).exists()})
    if missing:
        raise Failed(f"{path}: sandbox paths missing under {base}: {', '.join(missing)}",
                     "create them, or fix ro_paths/rw_paths in the servers file")
    note = f"; unsandboxed: {', '.join(f'{k} ({v})' for k, v in unsandboxed.items())}" if unsandboxed else ""
    egress = [f"{s.name}/{role} to {', '.join(e.sandbox.egress.allow)}" for s in servers.values()
              for role, e in (("write", s.write), ("read", s.read))
              if e.transport == "stdio" and e.sandbox.enabled and e.sandbox.egress is not None]
    note += f"; egress allowed: {'; '.join(egress)[:300]}" if egress else ""
    found = (", bwrap runs" if sandboxed else "") + (", strace found" if sandboxed and strace_available() else "")
    return f"{len(servers)} server(s) in {path}{found}{note}"


def check_pins(settings: Settings, publishing: bool = True) -> str:
    """The pinned contract registry reads, and (``publishing``: what ``proofline publish`` needs)
    pins every contract's tool. A worker never reads the pins, so for it only a file that exists
    and cannot be read fails; contracts left unpinned are named in the answer."""
    from proofline.contracts import scan_contracts
    from proofline.pins import pins_path, problems, read_pins

    path = pins_path(settings)
    fix = "run `proofline contracts pin` and review what it records, or set PROOFLINE_PINS_FILE"
    if not path.exists():
        if publishing:
            raise Failed(f"no pins file at {path}: `proofline publish` has no reviewed tool contracts", fix)
        return f"no pins file at {path} (a worker needs none; `proofline publish` does)"
    try:
        pins = read_pins(path)
    except ProoflineError as exc:
        raise Failed(exc.detail[:400], fix) from None
    found = problems(pins, scan_contracts(Path(settings.contracts_dir)).contracts, path)
    named = "; ".join(f"{action}: {code}" for action, (code, _) in sorted(found.items()))
    if found and publishing:
        raise Failed(f"{path}: {named[:400]}", fix)
    pinned = f"{sum(len(p.tools) for p in pins.values())} tool(s) pinned in {path}"
    return pinned + (f"; not publishable until pinned: {named[:300]}" if found else "")


#: Checks that read the database: not run (and failed) when it cannot be reached.
NEEDS_DATABASE = ("migrations", "reconciler")


def worker_checks(settings: Settings, role: str, warnings: list[str]) -> list[tuple[str, Any]]:
    """What a worker checks before it consumes, in order (each a name and a call): the process's own
    keys and rules first, the production rules on its key files, broker and database login
    (``proofline/production_checks.py``), then its files, then the database. Not whether the broker
    is up (Celery waits for it and reconnects) nor the reconciler's heartbeat (a worker may be the
    first process to start)."""
    return [("keys", lambda: check_keys(settings, role)), ("environment", lambda: check_environment(settings)),
            ("key-files", lambda: check_key_files(settings, role)),
            ("broker-auth", lambda: check_broker_auth(settings)),
            ("db-auth", lambda: check_database_auth(settings, own=True)),
            ("authority", lambda: check_authority(settings)),
            ("servers", lambda: check_servers(settings)), ("contracts", lambda: check_contracts(settings, warnings)),
            ("evidence_capture", lambda: check_evidence_capture(settings, warnings)),
            ("pins", lambda: check_pins(settings, publishing=False)),
            ("database", lambda: check_database(settings, own=True)),
            ("migrations", lambda: check_migrations(settings, own=True))]


def refuse_bad_setup(settings: Settings, role: str) -> list[str]:
    """Run :func:`worker_checks`; the first that fails stops the process with one line: the check,
    what is wrong (the file, and the line where there is one) and the fix. Returns the warnings
    of the checks that passed (a refused contract file), for the worker to print.

    Raises ConfigurationError (``configuration_error``, exit 3) with ``check`` in its context."""
    warnings: list[str] = []
    for name, check in worker_checks(settings, role, warnings):
        try:
            check()
        except Failed as exc:
            raise ConfigurationError(f"the worker refuses to start: {name}: {exc.detail}; fix: {exc.fix}",
                                     check=name) from None
    return warnings
