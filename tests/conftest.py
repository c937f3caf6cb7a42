"""Fixtures that start real components: a fresh Postgres database per stack (migrated with
Alembic), a Redis database, the system-of-record MCP server (stdio or streamable HTTP) and real
Celery worker processes. Nothing here is mocked."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis
from celery import Celery

from ledger import seal, store
from ledger.migrate import upgrade
from ledger.states import ActionStatus
from proofline.controller import describe_server, prepare, publish, publish_run, send_message, signed_message
from proofline.envelope import Envelope
from proofline.keys import generate as generate_keys
from proofline.settings import ROOT, Settings
from proofline_kit.sor import store as sor
from proofline_kit.witness import WitnessLog
from proofline_kit.witness.placement import READ_SUFFIX, http_relay_argv, witness_stdio_servers

ADMIN_URL = os.environ.get("PROOFLINE_TEST_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("PROOFLINE_TEST_REDIS_URL", "redis://127.0.0.1:6379")
CANARY_SECRET = "canary-must-never-reach-a-tool"
SETTLED = (ActionStatus.closed, ActionStatus.escalated, ActionStatus.cancelled)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05, what: str = "") -> Any:
    """Poll until ``predicate`` returns something truthy; fail the test with ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(interval)


def with_database(url: str, dbname: str, user: str | None = None) -> str:
    """The same server URL (TCP or unix socket) for another database and, optionally, user."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if user is not None:
        netloc = f"{user}@{netloc.rsplit('@', 1)[-1]}" if "@" in netloc else f"{user}@{netloc}"
    return urlunsplit((parts.scheme, netloc, f"/{dbname}", parts.query, parts.fragment))


#: The database roles migration 0003 creates (short name -> role), and the development role.
DB_ROLES = {"controller": "proofline_controller", "worker": "proofline_worker", "recovery": "proofline_recovery",
            "operator": "proofline_operator", "reader": "proofline_reader", "runtime": "proofline_runtime"}


def create_database(prefix: str, maintenance_url: str = ADMIN_URL) -> tuple[str, str]:
    """A new, migrated database; returns (admin url, runtime-role url). ``role_urls`` gives the rest."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(maintenance_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    admin = with_database(maintenance_url, name)
    upgrade(admin)
    return admin, with_database(maintenance_url, name, user="proofline_runtime")


def role_urls(admin_url: str) -> dict[str, str]:
    """The URL of each database role (``DB_ROLES`` keys) for the database ``admin_url`` names."""
    name = urlsplit(admin_url).path.lstrip("/")
    return {short: with_database(admin_url, name, user=role) for short, role in DB_ROLES.items()}


def drop_database(admin_url: str) -> None:
    name = urlsplit(admin_url).path.lstrip("/")
    with psycopg.connect(with_database(admin_url, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_process(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    handle = open(log, "ab")  # noqa: SIM115 - the child owns it for its life
    return subprocess.Popen(argv, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL of the process group we started it in (its children included)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session made proc.pid the group id
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(5)


def wait_port(port: int, timeout: float = 20.0) -> None:
    def answers() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            return False

    wait_for(answers, timeout, what=f"port {port}")


@dataclass
class Stack:
    """One running Proofline deployment: ledger database, broker, system of record, workers."""

    transport: str
    workdir: Path
    admin_url: str
    database_url: str
    broker_url: str
    sor_db: Path
    servers_file: Path
    settings: Settings
    app: Celery
    conn: psycopg.Connection
    env: dict[str, str]
    processes: list[subprocess.Popen] = field(default_factory=list)
    workers: list[subprocess.Popen] = field(default_factory=list)
    _live: tuple[str | None, dict[str, str]] | None = None
    #: The TCP fault proxy between workers and the writer ("http-proxy" stacks only).
    proxy: Any = None
    #: Every tools/call the workers sent to any server, as the witness relays saw it.
    witness: WitnessLog | None = None
    @property
    def seal_key(self) -> seal.SealKey:
        return seal.sealer_for(self.settings)

    @property
    def faultpoints(self) -> Path:
        return self.workdir / "faultpoints.json"

    #: How to (re)start the HTTP writer: argv, environment, port ("http" stacks only).
    writer: dict[str, Any] = field(default_factory=dict)
    #: URL per database role (``DB_ROLES`` keys). ``conn`` is the controller's, the workers run as
    #: ``runtime`` (development: worker + recovery), ``operator`` is for operator paths.
    urls: dict[str, str] = field(default_factory=dict)
    _operator: psycopg.Connection | None = None

    @property
    def operator(self) -> psycopg.Connection:
        """A connection as proofline_operator: kill switches, revocations, cancellations, resolutions."""
        if self._operator is None or self._operator.closed:
            self._operator = store.connect(self.urls["operator"])
        return self._operator

    def restart_writer(self, **env: str) -> None:
        """Restart the HTTP system-of-record writer on the same port with extra environment
        (for example a changed tool schema); the workers' sessions meet the new server."""
        old = self.writer["process"]
        stop_process(old, grace=2.0)
        self.processes.remove(old)
        proc = start_process(self.writer["argv"], {**self.env, **env}, self.workdir / "sor-writer.log")
        self.processes.append(proc)
        self.writer["process"] = proc
        wait_port(self.writer["port"])
        self._live = None

    # --- controller side ---------------------------------------------------------------------
    def live(self) -> tuple[str | None, dict[str, str]]:
        if self._live is None:
            self._live = describe_server(self.settings, "sor")
        return self._live

    def envelope(self, action_type: str, **kw: Any) -> Envelope:
        uid = uuid.uuid4().hex[:10]
        kw.setdefault("run_id", f"run-{uid}")
        kw.setdefault("action_id", f"act-{uid}")
        kw.setdefault("tenant", "acme")
        kw.setdefault("live", self.live())
        return prepare(self.settings, action_type=action_type, **kw)

    def publish(self, envelope: Envelope) -> dict[str, Any]:
        return publish(self.settings, self.conn, self.app, envelope)

    def publish_run(self, envelopes: list[Envelope]) -> list[dict[str, Any]]:
        return publish_run(self.settings, self.conn, self.app, envelopes)

    def deliver(self, message: Any) -> str:
        """Put a raw message on the actions queue, as a duplicate or hostile delivery would."""
        return send_message(self.app, message)

    def message(self, envelope: Envelope) -> dict[str, Any]:
        return signed_message(self.settings, envelope)

    # --- observation ----------------------------------------------------------------------------
    def action(self, action_id: str) -> store.ActionRow | None:
        with self.conn.cursor() as cur:
            return store.get_action(cur, action_id)

    def events(self, action_id: str) -> list[str]:
        with self.conn.cursor() as cur:
            return [e["event"] for e in store.timeline(cur, action_id)]

    def timeline(self, action_id: str) -> list[dict[str, Any]]:
        with self.conn.cursor() as cur:
            return store.timeline(cur, action_id)

    def wait_settled(self, action_id: str, timeout: float = 40.0) -> store.ActionRow:
        def settled() -> store.ActionRow | None:
            row = self.action(action_id)
            return row if row is not None and row.status in SETTLED else None

        return wait_for(settled, timeout, what=f"{action_id} to settle (now {self.action(action_id)})")

    def wait_event(self, action_id: str, event: str, timeout: float = 30.0) -> None:
        wait_for(lambda: event in self.events(action_id), timeout, what=f"{event} on {action_id}")

    def refusals(self) -> list[dict[str, Any]]:
        with self.conn.cursor() as cur:
            cur.execute("SELECT action_id, evidence FROM ledger_events WHERE event = 'envelope_refused' ORDER BY id")
            return list(cur.fetchall())

    def effects(self, key: str) -> int:
        return sor.count_effects(self.sor_db, key)

    def workers_alive(self) -> bool:
        return all(w.poll() is None for w in self.workers)


def _servers_yaml(transport: str, write_port: int | None, read_port: int | None, witness_log: Path) -> str:
    if transport == "stdio":
        return witness_stdio_servers((ROOT / "servers.yaml").read_text(), witness_log)
    # "http-legacy": the initialize-handshake protocol with HTTP sessions, as 1.x-SDK servers speak.
    protocol = "legacy" if transport == "http-legacy" else "auto"
    return (
        "servers:\n  sor:\n    transport: http\n"
        f"    url: http://127.0.0.1:{write_port}/mcp\n    protocol: {protocol}\n    expected_version: \"1.0.0\"\n"
        f"    read_identity:\n      url: http://127.0.0.1:{read_port}/mcp\n"
    )


def start_workers(stack: Stack, count: int = 1, concurrency: int = 2, name: str = "w",
                  beat: bool = True, role: str = "all", env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Real Celery workers; the first also runs beat (the reconciler's clock) unless told not to.
    ``role`` is ``proofline worker --role`` (execute, recovery, or all: both in one process)."""
    started = []
    for i in range(count):
        # The same supervised worker an operator runs (``proofline worker``): restarted if Celery dies.
        argv = [sys.executable, "-m", "proofline", "worker", "--role", role, "--concurrency", str(concurrency), "--without-gossip", "--without-mingle", "--without-heartbeat",
                "-n", f"{name}{i}-{uuid.uuid4().hex[:6]}@%h"]
        if beat and i == 0:
            argv += ["-B", "-s", str(stack.workdir / f"beat-{name}.db")]
        proc = start_process(argv, env or stack.env, stack.workdir / f"worker-{name}{i}.log")
        started.append(proc)
    stack.workers.extend(started)
    client = redis.Redis.from_url(stack.broker_url)
    # A worker is ready when it has subscribed to its queues (it then shows in the broker's bindings).
    binding = "_kombu.binding.recovery" if role == "recovery" else "_kombu.binding.actions"
    wait_for(lambda: client.exists(binding) and all(p.poll() is None for p in started), 30,
             what="workers to start")
    time.sleep(1.0)
    return started


CLAIM_KEY = "proofline:test-claim"


def claim_redis_db(base_url: str = REDIS_URL, candidates: range = range(1, 16)) -> int:
    """A Redis database no other test session is using: claimed with SET NX (expiring), then
    emptied. Concurrent pytest sessions on one Redis would otherwise consume each other's tasks."""
    for number in candidates:
        client = redis.Redis.from_url(f"{base_url}/{number}")
        if client.set(CLAIM_KEY, str(os.getpid()), nx=True, ex=3 * 3600):
            client.flushdb()
            client.set(CLAIM_KEY, str(os.getpid()), ex=3 * 3600)
            return number
    raise RuntimeError("every Redis database is claimed by another test session")


def release_redis_db(broker_url: str) -> None:
    client = redis.Redis.from_url(broker_url)
    if client.get(CLAIM_KEY) == str(os.getpid()).encode():
        client.flushdb()


def start_witness(processes: list[subprocess.Popen], upstream: str, log: Path, name: str, tmp: Path,
                  env: dict[str, str]) -> int:
    """An HTTP witness relay in front of ``upstream``; returns the port it bound (it picks one)."""
    port_file = tmp / "witness" / f"{name.replace(':', '-')}.port"
    port_file.unlink(missing_ok=True)
    processes.append(start_process(http_relay_argv(upstream, log, name, port_file), env,
                                   tmp / f"witness-{name.replace(':', '-')}.log"))
    wait_for(lambda: port_file.exists() or processes[-1].poll() is not None, 20, what=f"witness {name} to bind")
    if not port_file.exists():
        raise RuntimeError(f"witness relay {name} exited with {processes[-1].returncode}")
    return int(port_file.read_text())


def build_stack(transport: str, tmp: Path, redis_db: int | None = None, extra_env: dict[str, str] | None = None,
                redis_url: str | None = None, maintenance_url: str = ADMIN_URL) -> Stack:
    admin, runtime_url = create_database(f"pl_{transport.replace('-', '_')}", maintenance_url)
    if redis_db is None:
        redis_db = claim_redis_db(redis_url or REDIS_URL)
    else:
        redis.Redis.from_url(f"{redis_url or REDIS_URL}/{redis_db}").flushdb()
    broker = f"{redis_url or REDIS_URL}/{redis_db}"
    # Under the servers file's cwd ("var"): the sandboxed writer may write only there.
    sor_db = tmp / "var" / "sor.sqlite3"
    sor.init_db(sor_db)
    sor.seed_demo(sor_db)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "SOR_"))}
    urls = role_urls(admin)
    # Development keys per stack: controller, recovery, ledger and seal keys and the keyring.
    keys_dir = tmp / "keys"
    generate_keys(keys_dir, force=True, development=True)
    env.update({
        "PROOFLINE_DATABASE_URL": runtime_url, "PROOFLINE_BROKER_URL": broker, "PROOFLINE_KEYS_DIR": str(keys_dir),
        # The CLI's controller, operator and reader commands each connect as their own role.
        "PROOFLINE_CONTROLLER_DATABASE_URL": urls["controller"], "PROOFLINE_OPERATOR_DATABASE_URL": urls["operator"],
        "PROOFLINE_READER_DATABASE_URL": urls["reader"],
        "PROOFLINE_LEASE_TTL_SECONDS": "4", "PROOFLINE_HEARTBEAT_SECONDS": "1",
        "SOR_DB": str(sor_db), "SOR_RESTART_SECONDS": "0.6", "PYTHONPATH": str(ROOT),
        "PROOFLINE_PROGRESS_EVENTS_LIMIT": "5",
        # The reconciler runs often and re-drives quickly, so tests see it work in seconds.
        "PROOFLINE_RECONCILE_INTERVAL_SECONDS": "1", "PROOFLINE_REDRIVE_AFTER_SECONDS": "3",
        "PROOFLINE_VERIFY_STALL_SECONDS": "30",
        # A credential in the worker's environment that no MCP server may inherit.
        "AWS_SECRET_ACCESS_KEY": CANARY_SECRET,
        # Test-only kill points inside the worker (worker/faultpoints.py), armed per test.
        "PROOFLINE_FAULT_POINTS_ENABLED": "true",
        "PROOFLINE_FAULT_POINTS_FILE": str(tmp / "faultpoints.json"),
    })
    processes = []
    witness_log = tmp / "witness" / "calls.jsonl"
    witness_log.parent.mkdir(parents=True, exist_ok=True)
    write_port = read_port = None
    writer: dict[str, Any] = {}
    proxy = None
    if transport.startswith("http"):
        write_port, read_port = free_port(), free_port()
        for role, port in (("writer", write_port), ("reader", read_port)):
            argv = [sys.executable, "-m", "proofline_kit.sor", "--transport", "http", "--port", str(port), "--role", role,
                    "--db", str(sor_db), "--sse"]
            processes.append(start_process(argv, env, tmp / f"sor-{role}.log"))
            if role == "writer":
                writer = {"argv": argv, "port": port, "process": processes[-1]}
        wait_port(write_port)
        wait_port(read_port)
        # The witness relays sit next to the servers: whatever reaches them reached the server.
        write_port, read_port = (
            start_witness(processes, f"http://127.0.0.1:{port}/mcp", witness_log, name, tmp, env)
            for port, name in ((write_port, "sor"), (read_port, "sor" + READ_SUFFIX)))
    worker_write_port = write_port
    if transport == "http-proxy":
        from proofline_kit.faults import FaultProxy

        proxy = FaultProxy(target=("127.0.0.1", write_port)).start()
        worker_write_port = proxy.port
    servers_file = tmp / "servers.yaml"
    servers_file.write_text(_servers_yaml(transport, worker_write_port, read_port, witness_log))
    env["PROOFLINE_SERVERS_FILE"] = str(servers_file)
    env.update(extra_env or {})
    settings = Settings(database_url=runtime_url, broker_url=broker, servers_file=servers_file, keys_dir=keys_dir,
                        **({"contracts_dir": env["PROOFLINE_CONTRACTS_DIR"]} if "PROOFLINE_CONTRACTS_DIR" in env else {}))
    seal.sealer_for(settings)  # this process opens the stack's sealed messages too
    app = Celery("proofline-test-controller", broker=broker)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True)
    conn = store.connect(urls["controller"])  # the controller side publishes as proofline_controller
    stack = Stack(transport, tmp, admin, runtime_url, broker, sor_db, servers_file, settings, app, conn, env,
                  processes, proxy=proxy, writer=writer, urls=urls, witness=WitnessLog(witness_log))
    # The controller probes the live server with the same environment the workers get.
    os.environ["SOR_DB"] = str(sor_db)
    return stack


def teardown_stack(stack: Stack) -> None:
    if stack.proxy is not None:
        stack.proxy.stop()
    for proc in stack.workers + stack.processes:
        stop_process(proc)
    stack.conn.close()
    if stack._operator is not None:
        stack._operator.close()
    stack.app.close()
    release_redis_db(stack.broker_url)
    if not os.environ.get("PROOFLINE_TEST_KEEP_DATABASES"):  # keep them to read a failure's ledger
        drop_database(stack.admin_url)




@pytest.fixture(scope="session", params=["stdio"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A running deployment with one Celery worker (two prefork processes). ``indirect``
    parametrisation with "http" gives the same deployment over streamable HTTP."""
    transport = request.param
    s = build_stack(transport, tmp_path_factory.mktemp(f"stack-{transport}"))
    try:
        start_workers(s)
        yield s
    finally:
        teardown_stack(s)


@pytest.fixture(autouse=True)
def _clear_faults(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "stack" in request.fixturenames:
        s: Stack = request.getfixturevalue("stack")
        sor.clear_faults(s.sor_db)
