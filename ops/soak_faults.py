"""The soak's fault injector: picks faults from a seeded ``random.Random`` and heals each one after
its duration. Every injected fault is recorded (kind, time, target, duration, parameters).

Kinds:

``worker_kill``      SIGKILL of one Celery pool child;
``worker_freeze``    SIGSTOP of one pool child for lease TTL + 2 s, then SIGCONT;
``redis_kill``       ``kill -9`` of the soak's own Redis, restarted on the same port (Redis broker);
``broker_node_kill`` SIGKILL of one node of the soak's three-node RabbitMQ cluster (any of them:
                     the first, which every client reaches first and whose queues it leads until a
                     failover, or a follower), brought back with its name, ports and data after
                     3-10 s; never two nodes down at once (a quorum queue needs two of three);
``pg_terminate``     ``pg_terminate_backend`` of the runtime role's sessions on the stack's database;
``proxy_blackhole`` / ``proxy_reset`` / ``proxy_delay``
                     the TCP fault proxy between workers and the writer, then back to ``pass``;
``read_outage``      the verification read path (reader identity) answers "unavailable" for a few
                     seconds, or (one in four) for longer than the verification bound;
``server_lie``       the writer answers the next one or two calls of one tool with success and
                     applies nothing (its reads stay honest: verification must not believe it);
``server_slow``      the writer waits 0.5-4 s before the next few calls of one tool;
``pg_restart``       the soak's private Postgres stopped (``fast``, or ``immediate`` as a crash) and
                     started again after 1-4 s;
``key_rotation``     once, in the middle of the window: the controller and recovery keys rotated
                     (``proofline keys rotate`` semantics, two hours' overlap) while work is in flight.

The embedded beat process (the reconciler's clock) is never a target.
"""

from __future__ import annotations

import heapq
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import psutil
import psycopg

from ops.soak_stack import SoakStack
from proofline_kit.sor import store as sor

KINDS = ("worker_kill", "worker_freeze", "redis_kill", "broker_node_kill", "pg_terminate", "proxy_blackhole",
         "proxy_reset", "proxy_delay", "read_outage", "server_lie", "server_slow", "pg_restart", "key_rotation")
#: The broker fault each broker can take (the other is left out of a soak's mix).
BROKER_FAULTS = {"redis": "redis_kill", "rabbitmq-cluster": "broker_node_kill"}
#: Kinds that share one switch: only one of them is active at a time (a terminated session while
#: Postgres is down would be no fault at all).
CATEGORY = {"proxy_blackhole": "proxy", "proxy_reset": "proxy", "proxy_delay": "proxy", "redis_kill": "broker",
            "broker_node_kill": "broker", "read_outage": "outage", "pg_restart": "postgres",
            "pg_terminate": "postgres"}
#: The write tools of the system of record a server fault may target.
WRITE_TOOLS = ("create_ticket", "issue_refund", "restart_service")
#: When in the fault window (its share) the keys are rotated, once.
ROTATION_AT = 0.5
#: When in the fault window the broker is sure to have failed once (its own fault, drawn at random
#: before and after too), so that even a short soak loses its broker or a node of it.
BROKER_LOSS_AT = 0.25
#: At most this many pool children are frozen at once (the rest keep the stack moving).
MAX_FROZEN = 2
#: Share of read outages that outlast the verification bound.
LONG_OUTAGE_SHARE = 0.25


@dataclass
class FaultRecord:
    kind: str
    #: Seconds since the soak started.
    at: float
    target: str
    duration: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)
    healed_at: float | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class FaultInjector:
    """Runs in its own thread for ``seconds``; :meth:`heal_all` ends every fault still active."""

    def __init__(self, soak: SoakStack, rng: random.Random, seconds: float, t0: float, *,
                 kinds: tuple[str, ...] = KINDS, gap: tuple[float, float] = (0.8, 3.0)) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds: {', '.join(sorted(unknown))}")
        self.soak, self.rng, self.seconds, self.t0 = soak, rng, seconds, t0
        self.kinds, self.gap = tuple(kinds), gap
        self.records: list[FaultRecord] = []
        self.active: dict[str, FaultRecord] = {}
        self.frozen: list[psutil.Process] = []
        #: (due, sequence, heal, record, whether the heal releases the record's category)
        self._heals: list[tuple[float, int, Callable[[], None], FaultRecord, bool]] = []
        self._seq = 0
        self.rotated = False
        #: Whether the broker fault of :data:`BROKER_LOSS_AT` is behind us.
        self.broker_lost = False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Brings a killed RabbitMQ node back (up to two minutes: the injector goes on meanwhile).
        self._restarting: threading.Thread | None = None
        self.thread_error: str | None = None

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> FaultInjector:
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def join(self) -> None:
        if self._thread is not None:
            while self._thread.is_alive():
                self._thread.join(0.5)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def snapshot(self) -> tuple[list[str], int]:
        """The kinds of the faults active now and how many processes are frozen (for progress)."""
        with self._lock:
            return sorted(r.kind for r in self.active.values()), len(self.frozen)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _lose_broker(self) -> None:
        """Once: the soak's broker fault, unless one was injected already (or its broker is down)."""
        with self._lock:
            done = any(r.kind in BROKER_FAULTS.values() and not r.error for r in self.records)
        fault = next((k for k in self._available() if k in BROKER_FAULTS.values()), None)
        if done or fault is not None:
            self.broker_lost = True
        if not done and fault is not None:
            self._inject(fault)

    def _run(self) -> None:
        try:
            end = time.monotonic() + self.seconds
            next_at = time.monotonic() + self.rng.uniform(*self.gap) / 2
            while not self._stop.is_set() and time.monotonic() < end:
                self._heal_due(time.monotonic())
                if "key_rotation" in self.kinds and not self.rotated and self.now() >= ROTATION_AT * self.seconds:
                    self._inject("key_rotation")
                if not self.broker_lost and self.now() >= BROKER_LOSS_AT * self.seconds:
                    self._lose_broker()
                if time.monotonic() >= next_at:
                    self._inject_one()
                    next_at = time.monotonic() + self.rng.uniform(*self.gap)
                self._stop.wait(0.05)
        except Exception as exc:  # noqa: BLE001 - reported by the soak, never silent
            self.thread_error = repr(exc)

    # --- healing --------------------------------------------------------------------------------
    def _schedule_heal(self, after: float, fn: Callable[[], None], record: FaultRecord,
                       keeps_category: bool = False) -> None:
        """Heal ``record`` with ``fn`` in ``after`` seconds. ``keeps_category``: ``fn`` only starts
        the healing, and whatever finishes it releases the fault's category."""
        with self._lock:
            self._seq += 1
            heapq.heappush(self._heals, (time.monotonic() + after, self._seq, fn, record, not keeps_category))

    def _heal_due(self, now: float) -> None:
        while True:
            with self._lock:
                if not self._heals or self._heals[0][0] > now:
                    return
                _due, _seq, fn, record, release = heapq.heappop(self._heals)
            self._heal(fn, record, release)

    def _heal(self, fn: Callable[[], None], record: FaultRecord, release: bool = True) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - recorded; heal_all tries again
            record.error = f"heal failed: {exc!r}"
        record.healed_at = round(self.now(), 3)
        if not release:
            return
        with self._lock:
            category = CATEGORY.get(record.kind)
            if category and self.active.get(category) is record:
                del self.active[category]

    def heal_all(self) -> list[str]:
        """End every fault now (scheduled heals first), then make sure of each switch."""
        self.stop()
        while True:
            with self._lock:
                if not self._heals:
                    break
                _due, _seq, fn, record, release = heapq.heappop(self._heals)
            self._heal(fn, record, release)
        problems: list[str] = []
        soak = self.soak
        try:
            if soak.proxy is not None:
                soak.proxy.set_mode("pass")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"proxy: {exc!r}")
        try:
            sor.set_read_outage(soak.stack.sor_db, False, role="reader")
            for tool in WRITE_TOOLS:  # unspent lies and delays
                sor.clear_faults(soak.stack.sor_db, tool)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"server faults: {exc!r}")
        try:
            soak.start_postgres()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"postgres: {exc!r}")
        try:
            if soak.redis is not None and not soak.redis.running:
                soak.redis.start()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"redis: {exc!r}")
        if self._restarting is not None:
            self._restarting.join(180)
        for member in soak.cluster.nodes if soak.cluster is not None else ():
            try:
                if not member.running:
                    soak.cluster.restart(member)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"rabbitmq {member.node}: {exc!r}")
        for proc in soak.all_worker_processes():
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
        with self._lock:
            self.frozen.clear()
            self.active.clear()
        return problems

    # --- injection ------------------------------------------------------------------------------
    def _available(self) -> list[str]:
        with self._lock:
            busy = set(self.active)
            frozen = len([p for p in self.frozen if _alive(p)])
        out = []
        for kind in self.kinds:
            if CATEGORY.get(kind) in busy:
                continue
            if kind == "worker_freeze" and frozen >= MAX_FROZEN:
                continue
            if kind == "pg_restart" and self.soak.postgres is None:
                continue
            if (kind == "redis_kill" and self.soak.redis is None) or (kind == "broker_node_kill" and
                                                                      self.soak.cluster is None):
                continue
            if kind == "key_rotation":  # not drawn: it happens once, in the middle (see _run)
                continue
            out.append(kind)
        return out

    def _inject_one(self) -> None:
        choices = self._available()
        if not choices:
            return
        self._inject(self.rng.choice(choices))

    def _inject(self, kind: str) -> None:
        record = FaultRecord(kind, round(self.now(), 3), "")
        try:
            getattr(self, f"_{kind}")(record)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is still recorded
            record.error = repr(exc)[:300]
        with self._lock:
            self.records.append(record)

    def _pick_child(self, exclude_frozen: bool) -> psutil.Process | None:
        children = sorted(self.soak.pool_children(), key=lambda p: p.pid)
        if exclude_frozen:
            frozen = {p.pid for p in self.frozen}
            children = [c for c in children if c.pid not in frozen]
        if not children:
            return None
        return self.rng.choice(children)

    def _worker_kill(self, record: FaultRecord) -> None:
        child = self._pick_child(exclude_frozen=False)
        if child is None:
            raise RuntimeError("no pool child to kill")
        record.target = f"pid {child.pid} (worker {child.ppid()})"
        child.send_signal(signal.SIGKILL)

    def _worker_freeze(self, record: FaultRecord) -> None:
        child = self._pick_child(exclude_frozen=True)
        if child is None:
            raise RuntimeError("no pool child to freeze")
        record.target = f"pid {child.pid} (worker {child.ppid()})"
        record.duration = round(self.soak.lease_ttl + 2.0, 3)
        child.send_signal(signal.SIGSTOP)
        with self._lock:
            self.frozen.append(child)

        def thaw() -> None:
            with self._lock:
                if child in self.frozen:
                    self.frozen.remove(child)
            try:
                child.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                record.detail["died_while_frozen"] = True

        self._schedule_heal(record.duration, thaw, record)

    def _redis_kill(self, record: FaultRecord) -> None:
        redis_server = self.soak.redis
        assert redis_server is not None
        record.target = f"redis-server pid {redis_server.proc.pid if redis_server.proc else '?'} " \
                        f"port {redis_server.port}"
        record.duration = round(self.rng.uniform(0.5, 3.0), 3)
        redis_server.kill()
        with self._lock:
            self.active["broker"] = record
        self._schedule_heal(record.duration, redis_server.start, record)

    def _broker_node_kill(self, record: FaultRecord) -> None:
        cluster = self.soak.cluster
        assert cluster is not None
        member = self.rng.choice(cluster.nodes)
        first = member is cluster.nodes[0]
        record.target = f"rabbitmq node {member.node} ({'first of every client' if first else 'follower'})"
        record.duration = round(self.rng.uniform(3.0, 10.0), 3)
        record.detail = {"first_node": first}
        with self._lock:
            self.active["broker"] = record
        try:
            cluster.kill(member)
        except BaseException:
            with self._lock:
                self.active.pop("broker", None)
            raise

        def back() -> None:
            # The node's restart waits for it to rejoin (seconds to a minute): in a thread of its own,
            # the broker category held until it is back, so that no second node goes down meanwhile.
            def restart() -> None:
                try:
                    cluster.restart(member)
                except Exception as exc:  # noqa: BLE001 - recorded; heal_all tries again
                    record.error = f"restart failed: {exc!r}"[:300]
                record.detail["back_at"] = round(self.now(), 3)
                with self._lock:
                    if self.active.get("broker") is record:
                        del self.active["broker"]

            self._restarting = threading.Thread(target=restart, name="soak-rabbitmq-restart", daemon=True)
            self._restarting.start()

        self._schedule_heal(record.duration, back, record, keeps_category=True)

    def _pg_terminate(self, record: FaultRecord) -> None:
        everyone = self.rng.random() < 0.5
        pick = self.rng.random()
        with psycopg.connect(self.soak.maintenance_url, autocommit=True, connect_timeout=10) as conn:
            rows = conn.execute(
                "SELECT pid, application_name FROM pg_stat_activity WHERE datname = %s AND usename = "
                "'proofline_runtime' AND pid <> pg_backend_pid() ORDER BY pid", (self.soak.db_name,)).fetchall()
            if not everyone and rows:
                rows = [rows[int(pick * len(rows))]]
            killed = [pid for pid, _app in rows
                      if conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]]
        record.target = "all runtime sessions" if everyone else "one runtime session"
        record.detail = {"terminated": len(killed), "applications": sorted({app for _pid, app in rows})}

    def _proxy(self, record: FaultRecord, mode: str, duration: float, **params: Any) -> None:
        proxy = self.soak.proxy
        assert proxy is not None
        record.target = f"proxy :{proxy.port} -> writer's witness relay :{self.soak.writer_port}"
        record.duration = round(duration, 3)
        record.detail = {"mode": mode, **params}
        proxy.set_mode(mode, **params)
        with self._lock:
            self.active["proxy"] = record
        self._schedule_heal(record.duration, lambda: proxy.set_mode("pass"), record)

    def _proxy_blackhole(self, record: FaultRecord) -> None:
        forward_close = self.rng.random() < 0.5
        self._proxy(record, "blackhole", self.rng.uniform(2.0, 6.0), forward_close=forward_close)

    def _proxy_reset(self, record: FaultRecord) -> None:
        after_request = self.rng.random() < 0.5
        self._proxy(record, "reset", self.rng.uniform(1.0, 4.0), after_request=after_request)

    def _proxy_delay(self, record: FaultRecord) -> None:
        seconds = round(self.rng.uniform(0.3, 3.0), 3)
        direction = self.rng.choice(("both", "request", "response"))
        self._proxy(record, "delay", self.rng.uniform(2.0, 6.0), seconds=seconds, direction=direction)

    def _read_outage(self, record: FaultRecord) -> None:
        db = self.soak.stack.sor_db
        record.target = "system of record, reader identity"
        # Mostly a few seconds (verification rides it out); sometimes past the contracts'
        # verification bound (10 s), so that actions escalate as completed_unverified and runs unwind.
        long = self.rng.random() < LONG_OUTAGE_SHARE
        record.duration = round(self.rng.uniform(11.0, 14.0) if long else self.rng.uniform(2.0, 8.0), 3)
        record.detail = {"past_verification_bound": long}
        sor.set_read_outage(db, True, role="reader")
        with self._lock:
            self.active["outage"] = record
        self._schedule_heal(record.duration, lambda: sor.set_read_outage(db, False, role="reader"), record)

    def _server_fault(self, record: FaultRecord, mode: str, shots: int, delay: float = 0.0) -> None:
        tool = self.rng.choice(WRITE_TOOLS)
        record.target = f"system of record, {tool}"
        record.detail = {"mode": mode, "calls": shots, **({"delay_seconds": delay} if delay else {})}
        sor.set_fault(self.soak.stack.sor_db, tool, mode, remaining=shots, delay_seconds=delay)

    def _server_lie(self, record: FaultRecord) -> None:
        self._server_fault(record, "lie", self.rng.randint(1, 2))

    def _server_slow(self, record: FaultRecord) -> None:
        self._server_fault(record, "delay", self.rng.randint(1, 4), round(self.rng.uniform(0.5, 4.0), 3))

    def _pg_restart(self, record: FaultRecord) -> None:
        mode = self.rng.choice(("fast", "immediate"))
        record.target = "the soak's Postgres"
        record.duration = round(self.rng.uniform(1.0, 4.0), 3)
        record.detail = {"mode": mode}
        with self._lock:
            self.active["postgres"] = record
        try:
            self.soak.stop_postgres(mode)
        except BaseException:
            with self._lock:
                self.active.pop("postgres", None)
            raise
        self._schedule_heal(record.duration, self.soak.start_postgres, record)

    def _key_rotation(self, record: FaultRecord) -> None:
        from proofline.keys import KeyRole, rotate

        assert self.soak.keys_dir is not None
        self.rotated = True
        record.target = "controller and recovery keys"
        ids = {role.value: rotate(self.soak.keys_dir, role, timedelta(hours=2))
               for role in (KeyRole.controller, KeyRole.recovery)}
        record.detail = {role: {"old": old, "new": new} for role, (old, new) in ids.items()}


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
