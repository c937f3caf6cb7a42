"""A whole Proofline deployment started from Python, for tests, the soak and the benchmarks (no
pytest needed): a fresh migrated Postgres database, a broker (a claimed Redis database, or a fresh
RabbitMQ virtual host), the demo system of record over stdio or streamable HTTP behind witness
relays, and real Celery worker processes.

Nothing here is mocked. Every server binds port 0 and reports the port it got; everything is
stopped by the process id this module started; the databases dropped and flushed are only the
ones created or claimed here (``proofline_kit.resources``).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import uuid
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import psycopg
import redis
from celery import Celery
from kombu import Connection

from ledger import seal, store
from ledger.states import ActionStatus, KillSwitchScope
from proofline.controller import describe_server, prepare, publish, publish_run, send_message, signed_message
from proofline.envelope import Envelope
from proofline.keys import generate as generate_keys
from proofline.settings import ROOT, Settings
from proofline_kit.audit import launch as audit_launch
from proofline_kit.processes import start_process, stop_process, stop_processes, wait_for, wait_port_file
from proofline_kit.resources import (
    ADMIN_URL,
    RABBITMQ_URL,
    RabbitVhost,
    RedisClaim,
    claim_redis_db,
    create_database,
    create_vhost,
    delete_vhost,
    drop_database,
    release_redis_db,
    role_urls,
)
from proofline_kit.sor import store as sor
from proofline_kit.witness import WitnessLog
from proofline_kit.witness.placement import READ_SUFFIX, http_relay_argv, witness_stdio_servers
from worker import broker as broker_options
from worker.transport import install as guard_transport

#: The brokers a stack can run on; tests of broker behaviour are parametrised over both.
BROKERS = ("redis", "rabbitmq")

CANARY_SECRET = "canary-must-never-reach-a-tool"
SETTLED = (ActionStatus.closed, ActionStatus.escalated, ActionStatus.cancelled)
#: A stdio probe's answer by :meth:`Stack._probe_key`. The probe starts the system of record under
#: bubblewrap, as a worker would, and that start (an interpreter importing the MCP SDK) is what it
#: costs; the same program with the same variables lists the same tools at the same version, so a
#: test process probes each variant once instead of once per stack.
_DESCRIBED: dict[tuple[Any, ...], tuple[str | None, dict[str, str]]] = {}

#: What every stack's workers get: short leases, a fast reconciler, bounded progress records.
STACK_ENV = {
    "PROOFLINE_LEASE_TTL_SECONDS": "4", "PROOFLINE_HEARTBEAT_SECONDS": "1",
    "SOR_RESTART_SECONDS": "0.6", "PROOFLINE_PROGRESS_EVENTS_LIMIT": "5",
    "PROOFLINE_RECONCILE_INTERVAL_SECONDS": "1", "PROOFLINE_REDRIVE_AFTER_SECONDS": "3",
    "PROOFLINE_VERIFY_STALL_SECONDS": "30",
    # No idle servers started ahead of need: a test stack's pool processes are few and long-lived,
    # and every spare is one more audited server start on a shared machine.
    "PROOFLINE_STDIO_SESSION_SPARES": "0",
    # Without spares a verification's read may wait on a cold server start, and with the whole suite
    # on two cores a sandboxed SDK server has taken more than the default 15 s to answer initialize.
    "PROOFLINE_MCP_CONNECT_TIMEOUT_SECONDS": "60",
    # The audit system lags the system of record by this much (the demo contracts allow for it).
    "AUDIT_DELAY_MS": "200",
    # A credential in the worker's environment that no MCP server may inherit.
    "AWS_SECRET_ACCESS_KEY": CANARY_SECRET,
}


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
    #: The Redis database this stack claimed (flushed at teardown only while still claimed).
    redis_claim: RedisClaim | None = None
    #: The RabbitMQ virtual host this stack created (deleted at teardown).
    rabbit_vhost: RabbitVhost | None = None
    #: How to (re)start the HTTP writer: argv, environment, port file, process ("http" stacks only).
    writer: dict[str, Any] = field(default_factory=dict)
    #: URL per database role (``DB_ROLES`` keys). ``conn`` is the controller's, the workers run as
    #: ``runtime`` (development: worker + recovery), ``operator`` is for operator paths.
    urls: dict[str, str] = field(default_factory=dict)
    _operator: psycopg.Connection | None = None
    #: The audit system's own store, fed from the system of record's effects (proofline_kit/audit).
    audit_db: Path | None = None

    @property
    def seal_key(self) -> seal.SealKey:
        return seal.sealer_for(self.settings)

    @property
    def faultpoints(self) -> Path:
        return self.workdir / "faultpoints.json"

    @property
    def operator(self) -> psycopg.Connection:
        """A connection as proofline_operator: kill switches, revocations, cancellations, resolutions."""
        if self._operator is None or self._operator.closed:
            self._operator = store.connect(self.urls["operator"])
        return self._operator

    def restart_writer(self, **env: str) -> None:
        """Restart the HTTP system-of-record writer with extra environment (for example a changed
        tool schema). It binds a new port of its choosing; the witness relay in front of it reads the
        port file at each new connection, so the workers' URL does not change."""
        old = self.writer["process"]
        self.writer["port_file"].unlink(missing_ok=True)
        stop_process(old, grace=2.0)
        self.processes.remove(old)
        proc = start_process(self.writer["argv"], {**self.env, **self.writer.get("env", {}), **env},
                             self.workdir / "sor-writer.log")
        self.processes.append(proc)
        self.writer["process"] = proc
        self.writer["port"] = wait_port_file(self.writer["port_file"], proc)
        self._live = None

    # --- controller side ---------------------------------------------------------------------
    def live(self) -> tuple[str | None, dict[str, str]]:
        """The writer's version and tool contract hashes, as the controller reads them from the live
        server (once per stack; a stdio stack whose probe would start the same program as an earlier
        stack's did takes that stack's answer: see :data:`_DESCRIBED`)."""
        if self._live is None:
            key = self._probe_key()
            self._live = _DESCRIBED.get(key) if key is not None else None
            if self._live is None:
                self._live = describe_server(self.settings, "sor")
                if key is not None:
                    _DESCRIBED[key] = self._live
        return self._live

    def _probe_key(self) -> tuple[Any, ...] | None:
        """Everything a stdio probe's answer depends on: the servers file (the stack's own folder
        taken out), the settings' environment, and the variables the probe reads from this process
        (``SOR_*``, which the servers file passes on, and ``PROOFLINE_*``, which settings read). None
        for an HTTP stack: its servers are already running, so its probe starts nothing."""
        if self.transport != "stdio":
            return None
        servers = self.servers_file.read_text().replace(str(self.workdir), "<stack>")
        variables = tuple(sorted((k, v) for k, v in os.environ.items()
                                 if k.startswith(("SOR_", "PROOFLINE_")) and k not in ("SOR_DB", "AUDIT_DB")))
        return servers, self.settings.environment, variables

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

    # The default waits are long: they end at the event, and only a failure waits them out; a
    # loaded host (parallel test workers, other sessions) can take a minute to pick a message up.
    def wait_settled(self, action_id: str, timeout: float = 120.0) -> store.ActionRow:
        def settled() -> store.ActionRow | None:
            row = self.action(action_id)
            return row if row is not None and row.status in SETTLED else None

        return wait_for(settled, timeout, what=lambda: f"{action_id} to settle\n{self.settle_report(action_id)}")

    def story(self, action_id: str) -> str:
        """An action's row and its ledger events in order: time, event, actor, evidence (cut short)."""
        row = self.action(action_id)
        head = (f"{action_id}: no row" if row is None else
                f"{action_id}: {row.status.value} outcome={row.outcome and row.outcome.value} reason={row.reason_code}")
        return "\n".join([head, *(f"  {e['at']:%H:%M:%S.%f} {e['event']} by {e['actor']} "
                                  f"{json.dumps(e['evidence'], default=str)[:600]}" for e in self.timeline(action_id))])

    def settle_report(self, action_id: str) -> str:
        """Where an action stood when a wait for it gave up: its story, whether the workers run, the
        broker's queue lengths, and each worker log's lines that name the action and its last lines."""
        lines = [self.story(action_id),
                 "workers: " + ", ".join(f"{w.pid} {'running' if w.poll() is None else f'exited {w.returncode}'}"
                                         for w in self.workers)]
        if self.broker == "redis":
            try:
                with closing(redis_client(self)) as client:
                    queued = [f"{q}={client.llen(q)}" for q in broker_options.work_queue_names(self.settings.tenant_shards)]
                    lines.append("queued: " + ", ".join(queued) + f"; unacked={client.hlen('unacked')}")
            except Exception as exc:  # noqa: BLE001 - a report of a failure must not fail differently
                lines.append(f"broker not readable: {exc}")
        for log in sorted(self.workdir.glob("worker-*.log")):
            text = log.read_text(errors="replace").splitlines()
            naming = [line for line in text if action_id in line][-20:]
            lines.append(f"{log.name}: {len(naming)} last lines naming {action_id}:\n  " + "\n  ".join(naming))
            lines.append(f"{log.name}, last lines:\n  " + "\n  ".join(text[-25:]))
        return "\n".join(lines)

    def wait_event(self, action_id: str, event: str, timeout: float = 90.0) -> None:
        wait_for(lambda: event in self.events(action_id), timeout, what=f"{event} on {action_id}")

    def refusals(self) -> list[dict[str, Any]]:
        with self.conn.cursor() as cur:
            cur.execute("SELECT action_id, evidence FROM ledger_events WHERE event = 'envelope_refused' ORDER BY id")
            return list(cur.fetchall())

    def effects(self, key: str) -> int:
        return sor.count_effects(self.sor_db, key)

    @property
    def broker(self) -> str:
        """``redis`` or ``rabbitmq``: which broker this stack runs on."""
        return "rabbitmq" if broker_options.is_amqp(self.broker_url) else "redis"

    def queued(self, queue: str) -> list[str | None]:
        """The task ids of the messages waiting in ``queue`` (left in place), on either broker."""
        if self.broker == "redis":
            return [_task_id(json.loads(item).get("headers")) for item in redis_client(self).lrange(queue, 0, -1)]
        ids: list[str | None] = []
        with Connection(self.broker_url) as conn:
            channel = conn.channel()  # closed unacknowledged: everything read goes back to the queue
            while len(ids) < 10_000:
                message = channel.basic_get(queue, no_ack=False)
                if message is None:
                    break
                ids.append(_task_id(message.headers))
            channel.close()
        return ids

    def workers_alive(self) -> bool:
        return all(w.poll() is None for w in self.workers)

    # --- what a test arms -------------------------------------------------------------------------
    def disarm(self) -> None:
        """Clear everything a test can arm on this stack: the system of record's faults (read
        outages included), the workers' fault points, every kill switch, the fault proxy's mode."""
        sor.clear_faults(self.sor_db)
        disarm_fault_points(self.faultpoints)
        from recovery.operator import clear_switch, list_switches

        for switch in list_switches(self.operator):
            clear_switch(self.operator, KillSwitchScope(switch["scope"]), switch["value"], "test-teardown",
                         "cleared when the test that set it ended")
        if self.proxy is not None:
            self.proxy.set_mode("pass")


def _task_id(headers: Any) -> str | None:
    value = headers.get("id") if isinstance(headers, dict) else None
    return value if isinstance(value, str) else None


def disarm_fault_points(path: Path) -> None:
    """Set every armed fault point to zero shots left and release any held worker (their fired
    counts are kept)."""
    if not path.exists():
        return
    with path.open("r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # the lock worker/faultpoints.py takes to fire one
        points = json.loads(handle.read() or "{}")
        for spec in points.values():
            spec["remaining"] = 0
            spec["released"] = spec.get("fired", 0)  # a worker held at a point ("hold") goes on
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(points))


def _servers_yaml(transport: str, write_port: int | None, read_port: int | None, witness_log: Path,
                  audit_port: int | None = None) -> str:
    if transport == "stdio":
        return witness_stdio_servers((ROOT / "servers.yaml").read_text(), witness_log)
    # "http-legacy": the initialize-handshake protocol with HTTP sessions, as 1.x-SDK servers speak.
    protocol = "legacy" if transport == "http-legacy" else "auto"
    audit = f"http://127.0.0.1:{audit_port}/mcp"
    return (
        "servers:\n  sor:\n    transport: http\n"
        f"    url: http://127.0.0.1:{write_port}/mcp\n    protocol: {protocol}\n    expected_version: \"1.0.0\"\n"
        f"    read_identity:\n      url: http://127.0.0.1:{read_port}/mcp\n"
        # The audit server has no write tool: both identities reach the one read-only server.
        f"  audit:\n    transport: http\n    url: {audit}\n    expected_version: \"1.0.0\"\n"
        f"    read_identity:\n      url: {audit}\n"
    )


def start_workers(stack: Stack, count: int = 1, concurrency: int = 2, name: str = "w",
                  beat: bool = True, role: str = "all", env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Real Celery workers; the first also runs beat (the reconciler's clock) unless told not to.
    ``role`` is ``proofline worker --role`` (execute, recovery, or all: both in one process).
    Returns once every new worker's consumer is on the broker."""
    baseline = _amqp_consumer_count(stack) if stack.broker == "rabbitmq" else 0
    # On RabbitMQ a worker is counted on ``actions`` and on ``reconcile`` (one each for role all).
    per_worker = 2 if role == "all" else 1
    started = []
    logs = []
    for i in range(count):
        # The same supervised worker an operator runs (``proofline worker``): restarted if Celery dies.
        argv = [sys.executable, "-m", "proofline", "worker", "--role", role, "--concurrency", str(concurrency),
                "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", f"{name}{i}-{uuid.uuid4().hex[:6]}@%h"]
        if beat and i == 0:
            argv += ["-B", "-s", str(stack.workdir / f"beat-{name}.db")]
        logs.append(stack.workdir / f"worker-{name}{i}.log")
        proc = start_process(argv, env or stack.env, logs[-1])
        started.append(proc)
    stack.workers.extend(started)

    seen: set[int] = set()  # the pids of the new workers seen consuming (Redis)

    def consuming() -> bool:
        dead = [p.args for p in started if p.poll() is not None]
        if dead:
            raise RuntimeError(f"a worker exited while starting: {dead}")
        if stack.broker == "rabbitmq":
            return _amqp_consumer_count(stack) >= baseline + count * per_worker
        # Each new worker by its own connection: a count against a baseline could count a connection
        # Redis had not yet seen closed, and then wait for one consumer too many. Which process holds
        # a port is only looked up once there are enough consumers for it to be worth the scan.
        waiting = _brpop_ports(stack)
        if len(waiting) >= count:
            seen.update(p.pid for p in started if p.pid not in seen and _broker_ports(stack, p) & waiting)
        return len(seen) == len(started)

    try:
        wait_for(consuming, 60, interval=0.1, what=f"{count} new worker(s) to consume from the broker")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_start_report(stack, started, logs)}") from None
    return started


def _tree(proc: Any) -> list[psutil.Process]:
    """``proc`` (a started process) and its descendants while they run."""
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _broker_ports(stack: Stack, proc: Any) -> set[int]:
    """The local ports of the connections ``proc``'s processes hold to the stack's Redis."""
    port = urlsplit(stack.broker_url).port
    ports: set[int] = set()
    for member in _tree(proc):
        try:
            held = member.net_connections("tcp") if hasattr(member, "net_connections") else member.connections("tcp")
        except psutil.Error:
            continue
        ports.update(c.laddr.port for c in held if c.raddr and c.raddr.port == port)
    return ports


def _redis_clients(stack: Stack) -> list[dict[str, Any]]:
    """Redis' client list for the stack's broker database."""
    client = redis_client(stack)
    try:
        db = int(urlsplit(stack.broker_url).path.strip("/") or 0)
        return [c for c in client.client_list() if int(c.get("db", -1)) == db]
    finally:
        client.close()


def _brpop_ports(stack: Stack) -> set[int]:
    """The client ports of the stack's Redis connections blocked in (or last seen in) BRPOP."""
    return {int(c["addr"].rsplit(":", 1)[1]) for c in _redis_clients(stack) if c.get("cmd") == "brpop"}


def _start_report(stack: Stack, started: list[Any], logs: list[Path]) -> str:
    """What a worker that was not seen consuming was doing: each process of its tree (state, kernel
    wait channel, broker connections), the broker's view and the end of its log."""
    lines = []
    for proc in started:
        lines.append(f"worker pid {proc.pid} ({'running' if proc.poll() is None else f'exited {proc.returncode}'}):")
        for member in _tree(proc):
            try:
                lines.append(f"  {member.pid} {member.status()} wchan={Path(f'/proc/{member.pid}/wchan').read_text()} "
                             f"threads={member.num_threads()} {' '.join(member.cmdline())[:160]}")
            except (psutil.Error, OSError):
                continue
        if stack.broker == "redis":
            lines.append(f"  its broker ports: {sorted(_broker_ports(stack, proc))}")
    try:
        if stack.broker == "redis":
            lines.append("redis clients: " + "; ".join(f"{c['addr']} cmd={c.get('cmd')} age={c.get('age')}"
                                                       for c in _redis_clients(stack)))
        else:
            lines.append(f"consumers of actions and reconcile now: {_amqp_consumer_count(stack)}")
    except Exception as exc:  # noqa: BLE001 - a report of a failure must not fail differently
        lines.append(f"broker not readable: {exc}")
    for log in logs:
        if log.exists():
            lines.append(f"end of {log}:\n" + log.read_text(errors="replace")[-3000:])
    return "\n".join(lines)


def _amqp_consumer_count(stack: Stack) -> int:
    """Consumers on ``actions`` plus those on ``reconcile`` (every role consumes one of them) in the
    stack's own RabbitMQ virtual host: each one is ours."""
    return sum(_amqp_consumers(stack.broker_url, queue) for queue in ("actions", "reconcile"))


def _amqp_consumers(url: str, queue: str) -> int:
    """Consumers of ``queue`` (0 while no worker has declared it yet, or the broker is away)."""
    try:
        with Connection(url, connect_timeout=2) as conn:
            return int(conn.channel().queue_declare(queue, passive=True).consumer_count)
    except Exception:  # noqa: BLE001 - not declared yet (404 closes the channel) or not reachable
        return 0


def start_witness(processes: list[subprocess.Popen], log: Path, name: str, workdir: Path, env: dict[str, str],
                  upstream: str | None = None, upstream_port_file: Path | None = None) -> int:
    """An HTTP witness relay in front of a server; returns the port the relay bound itself."""
    slug = name.replace(":", "-")
    port_file = workdir / "ports" / f"witness-{slug}.port"
    argv = http_relay_argv(log, name, port_file, upstream=upstream, upstream_port_file=upstream_port_file)
    processes.append(start_process(argv, env, workdir / f"witness-{slug}.log"))
    return wait_port_file(port_file, processes[-1])


def start_http_servers(tmp: Path, env: dict[str, str], sor_db: Path, witness_log: Path,
                        processes: list[subprocess.Popen]) -> tuple[dict[str, Any], int, int]:
    """Writer and reader on ports they pick, each behind a witness relay: (writer, relay ports)."""
    writer: dict[str, Any] = {}
    relay_ports = []
    for role, name in (("writer", "sor"), ("reader", "sor" + READ_SUFFIX)):
        port_file = tmp / "ports" / f"sor-{role}.port"
        argv = [sys.executable, "-m", "proofline_kit.sor", "--transport", "http", "--port", "0", "--port-file",
                str(port_file), "--role", role, "--db", str(sor_db), "--sse"]
        processes.append(start_process(argv, env, tmp / f"sor-{role}.log"))
        port = wait_port_file(port_file, processes[-1])
        if role == "writer":
            writer = {"argv": argv, "port": port, "port_file": port_file, "process": processes[-1]}
            # The writer may restart on another port: its relay reads the port file per connection.
            relay_ports.append(start_witness(processes, witness_log, name, tmp, env, upstream_port_file=port_file))
        else:
            relay_ports.append(start_witness(processes, witness_log, name, tmp, env,
                                             upstream=f"http://127.0.0.1:{port}/mcp"))
    return writer, relay_ports[0], relay_ports[1]


def build_stack(transport: str, tmp: Path, redis_db: int | None = None, extra_env: dict[str, str] | None = None,
                redis_url: str | None = None, maintenance_url: str = ADMIN_URL, broker: str = "redis",
                rabbitmq_url: str | None = None, server_env: dict[str, str] | None = None) -> Stack:
    """Start a stack's servers (no workers: ``start_workers``). ``transport`` is stdio, http,
    http-legacy or http-proxy (a FaultProxy between the workers and the writer's relay).
    ``broker`` is ``redis`` (a claimed database; ``redis_db`` asks for that number, claimed like any
    other: it must be free and empty) or ``rabbitmq``: a fresh virtual host on the system node, or
    ``rabbitmq_url`` used as it is (a private node the test owns, ``proofline_kit/rabbitmq_server.py``).
    ``server_env`` is added to the HTTP system of record's environment only (``SOR_OAUTH_ISSUER``:
    it requires the kit authorization server's tokens, proofline_kit/oauth)."""
    if broker not in BROKERS:
        raise ValueError(f"unknown broker {broker!r}: one of {BROKERS}")
    (tmp / "ports").mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen] = []
    claim = vhost = None
    if broker == "redis":
        claim = claim_redis_db(redis_url, range(redis_db, redis_db + 1) if redis_db is not None else None)
    elif rabbitmq_url is None:
        vhost = create_vhost(RABBITMQ_URL)

    def release() -> None:
        if claim is not None:
            release_redis_db(claim)
        if vhost is not None:
            delete_vhost(vhost)

    try:
        admin, runtime_url = create_database(f"pl_{transport.replace('-', '_')}", maintenance_url)
    except BaseException:
        release()
        raise
    broker_url = claim.url if claim is not None else vhost.url if vhost is not None else str(rabbitmq_url)
    try:
        stack = _assemble(transport, tmp, broker_url, admin, runtime_url, extra_env, processes, server_env)
    except BaseException:
        for proc in processes:
            stop_process(proc)
        release()
        drop_database(admin)
        raise
    stack.redis_claim, stack.rabbit_vhost = claim, vhost
    return stack


def _assemble(transport: str, tmp: Path, broker: str, admin: str, runtime_url: str,
              extra_env: dict[str, str] | None, processes: list[subprocess.Popen],
              server_env: dict[str, str] | None = None) -> Stack:
    # Under the servers file's cwd ("var"): the sandboxed writer may write only there.
    sor_db = tmp / "var" / "sor.sqlite3"
    sor.init_db(sor_db)
    sor.seed_demo(sor_db)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "SOR_"))}
    urls = role_urls(admin)
    # Development keys per stack: controller, recovery, ledger and seal keys and the keyring.
    keys_dir = tmp / "keys"
    generate_keys(keys_dir, force=True, development=True)
    env.update(STACK_ENV)
    env.update({
        "PROOFLINE_DATABASE_URL": runtime_url, "PROOFLINE_BROKER_URL": broker, "PROOFLINE_KEYS_DIR": str(keys_dir),
        # The CLI's controller, operator and reader commands each connect as their own role.
        "PROOFLINE_CONTROLLER_DATABASE_URL": urls["controller"], "PROOFLINE_OPERATOR_DATABASE_URL": urls["operator"],
        "PROOFLINE_READER_DATABASE_URL": urls["reader"],
        "SOR_DB": str(sor_db), "PYTHONPATH": str(ROOT),
        # Test-only kill points inside the worker (worker/faultpoints.py), armed per test.
        "PROOFLINE_FAULT_POINTS_ENABLED": "true",
        "PROOFLINE_FAULT_POINTS_FILE": str(tmp / "faultpoints.json"),
    })
    audit_db = tmp / "var" / "audit.sqlite3"
    env["AUDIT_DB"] = str(audit_db)
    audit_launch.prepare(audit_db)
    witness_log = tmp / "witness" / "calls.jsonl"
    witness_log.parent.mkdir(parents=True, exist_ok=True)
    write_port = read_port = audit_port = None
    writer: dict[str, Any] = {}
    proxy = None
    if transport.startswith("http"):
        # The witness relays sit next to the servers: whatever reaches them reached the server.
        writer, write_port, read_port = start_http_servers(tmp, {**env, **(server_env or {})}, sor_db, witness_log,
                                                           processes)
        writer["env"] = dict(server_env or {})
        audit_port = audit_launch.start_http_server(audit_db, env, tmp, processes)
    if transport == "http-proxy":
        from proofline_kit.faults import FaultProxy

        proxy = FaultProxy(target=("127.0.0.1", write_port)).start()
        write_port = proxy.port
    servers_file = tmp / "servers.yaml"
    servers_file.write_text(_servers_yaml(transport, write_port, read_port, witness_log, audit_port))
    env["PROOFLINE_SERVERS_FILE"] = str(servers_file)
    env.update(extra_env or {})
    audit_launch.start_feed(sor_db, audit_db, env, tmp / "audit-feed.log", processes)
    # What publishers and workers must agree on: RabbitMQ refuses a queue redeclared with another
    # delivery limit (or replica count), and the limit must stay above the guard's.
    agreed = {name: env[f"PROOFLINE_{name.upper()}"]
              for name in ("broker_delivery_limit", "max_unsettled_deliveries", "broker_quorum_group_size")
              if f"PROOFLINE_{name.upper()}" in env}
    settings = Settings(database_url=runtime_url, broker_url=broker, servers_file=servers_file, keys_dir=keys_dir,
                        **({"contracts_dir": env["PROOFLINE_CONTRACTS_DIR"]} if "PROOFLINE_CONTRACTS_DIR" in env else {}),
                        **agreed)
    seal.sealer_for(settings)  # this process opens the stack's sealed messages too
    if broker.startswith("redis://"):
        # The transport the SDK's own Client gets from worker.celery_config (guarded reads, one
        # Redis client per channel), so that what the stack publishes costs what a controller's does.
        guard_transport()
    app = Celery("proofline-test-controller", broker=broker)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True)
    # The same queue declarations as the workers' (RabbitMQ refuses a queue redeclared otherwise).
    app.conf.update(broker_options.celery_options(settings, broker))
    conn = store.connect(urls["controller"])  # the controller side publishes as proofline_controller
    stack = Stack(transport, tmp, admin, runtime_url, broker, sor_db, servers_file, settings, app, conn, env,
                  processes, proxy=proxy, writer=writer, urls=urls, witness=WitnessLog(witness_log), audit_db=audit_db)
    # The controller probes the live server with the same environment the workers get.
    os.environ["SOR_DB"] = str(sor_db)
    os.environ["AUDIT_DB"] = str(audit_db)
    return stack


def teardown_stack(stack: Stack) -> None:
    """Stop what the stack started (by process id), release its Redis claim, drop its database
    (kept when ``PROOFLINE_TEST_KEEP_DATABASES`` is set, to read a failure's ledger)."""
    if stack.proxy is not None:
        stack.proxy.stop()
    stop_processes(stack.workers + stack.processes)
    stack.conn.close()
    if stack._operator is not None:
        stack._operator.close()
    stack.app.close()
    if stack.redis_claim is not None:
        release_redis_db(stack.redis_claim)
    if stack.rabbit_vhost is not None:
        delete_vhost(stack.rabbit_vhost)
    if not os.environ.get("PROOFLINE_TEST_KEEP_DATABASES"):
        drop_database(stack.admin_url)


def redis_client(stack: Stack) -> redis.Redis:
    """A client of the stack's own (claimed) Redis database."""
    return redis.Redis.from_url(stack.broker_url)
