"""A chaos soak of the whole runtime: many concurrent actions while faults are injected, then a
check of the entire history once everything has healed and gone quiet.

    .venv/bin/python -m ops.soak --actions N --seconds S --seed K [--workers 2] [--json PATH]

What it does, in order:

1. starts its own deployment (``ops/soak_stack.py``): a private ``redis-server`` without
   persistence on a free loopback port (so it can be killed with SIGKILL and restarted), or with
   ``--broker rabbitmq-cluster`` a private three-node RabbitMQ cluster (quorum queues on all three
   nodes; one node at a time is SIGKILLed and brought back), the
   system of record over HTTP with the writer behind a TCP fault proxy (the reader, used by
   verification, is reached directly), a fresh migrated database (on a private embedded Postgres
   when the faults restart it) and ``--workers`` Celery workers (two prefork processes each; the
   first also runs beat, the reconciler's clock);
2. submits N work items at a steady rate over the first part of the fault window: single
   ``ticket.create`` (the downstream honours the key), ``refund.issue`` (it does not, and answers
   with text only), ``service.restart`` (asynchronous), 2-step runs (ticket then refund),
   duplicates (the same signed message delivered 2-3 times), conflicting duplicates (the same
   action id with other arguments, which must be refused) and pairs of actions on one shared
   target (one of them ends not started, or they serialise);
3. for S seconds injects faults picked by ``random.Random(seed)`` (``ops/soak_faults.py``): pool
   child SIGKILL, a pool child frozen past its lease, Redis ``kill -9`` and restart (or the loss
   of a RabbitMQ node), Postgres
   backend termination and a restart of the soak's own Postgres, proxy black-hole / reset / delay,
   verification read outage, a writer that lies or is slow, a key rotation mid-run;
4. heals everything and waits until no action is open for ``--quiet-seconds`` (at most
   ``--max-wait``). Nothing is re-published by the soak: lost work must be re-driven by the
   runtime's own reconciler;
5. checks the history (``ops/soak_check.py``), prints a summary and exits 1 when any invariant
   fails, naming the offending action ids and the seed to replay;
6. tears everything down, also on an error or Ctrl-C. ``PROOFLINE_TEST_KEEP_DATABASES=1`` (or
   ``--keep-database``) keeps the ledger database for ``python -m proofline forensics``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ledger import store
from ops import soak_stack
from ops.soak_check import INVARIANTS, CheckResult, Quiet, check, unsettled, wait_quiet
from ops.soak_faults import KINDS, FaultInjector
from proofline.envelope import Envelope
from proofline_kit.sor import store as sor

TENANTS = ("acme", "globex", "initech", "umbrella", "hooli", "vandelay")
#: Work item kinds and their weights.
MIX = {"ticket": 22, "refund": 22, "restart": 14, "run2": 12, "duplicate": 14, "conflict": 8, "shared": 8}
SHARED_TARGETS = 3


@dataclass
class SoakConfig:
    actions: int = 200
    seconds: float = 60.0
    seed: int = 1
    workers: int = 2
    concurrency: int = 2
    #: ``redis`` or ``rabbitmq-cluster`` (``ops/soak_stack.py``); each takes its own broker fault.
    broker: str = "redis"
    #: Submissions are spread over this fraction of the fault window.
    submit_fraction: float = 0.7
    quiet_seconds: float = 10.0
    max_wait: float = 240.0
    faults: tuple[str, ...] = KINDS
    #: Seconds between two faults (uniform in this range).
    fault_gap: tuple[float, float] = (0.8, 3.0)
    json_path: Path | None = None
    workdir: Path | None = None
    keep_database: bool = False
    #: Keep the ledger database only when an invariant fails (for ``proofline forensics``).
    keep_failed: bool = False
    progress: bool = True
    #: Put the ledger on a private embedded Postgres (None: when ``pg_restart`` is among the faults).
    private_postgres: bool | None = None

    @property
    def on_private_postgres(self) -> bool:
        return "pg_restart" in self.faults if self.private_postgres is None else self.private_postgres


@dataclass
class SoakResult:
    config: SoakConfig
    ok: bool = False
    error: str | None = None
    workdir: str = ""
    database_url: str = ""
    items: dict[str, int] = field(default_factory=dict)
    submitted_actions: int = 0
    controller: dict[str, int] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    heal_problems: list[str] = field(default_factory=list)
    quiet: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    violations: list[dict[str, str]] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)

    def offending(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for v in self.violations:
            out.setdefault(v["invariant"], []).append(v["subject"])
        return out

    def replay(self) -> str:
        c = self.config
        return (f"python -m ops.soak --actions {c.actions} --seconds {c.seconds:g} --seed {c.seed} "
                f"--workers {c.workers} --broker {c.broker}")

    def failure_text(self) -> str:
        lines = [f"soak seed {self.config.seed} failed ({self.error or 'invariants'}); replay: {self.replay()}"]
        for v in self.violations[:60]:
            lines.append(f"  [{v['invariant']}] {v['subject']}: {v['detail']}")
        if len(self.violations) > 60:
            lines.append(f"  ... and {len(self.violations) - 60} more")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.config).items()}
        doc["offending"] = self.offending()
        doc["replay"] = self.replay()
        return doc


# --- the workload --------------------------------------------------------------------------------
class Workload:
    """Builds and publishes the work items; keeps what was published for the checker."""

    def __init__(self, soak: soak_stack.SoakStack, rng: random.Random, config: SoakConfig) -> None:
        self.soak, self.rng, self.config = soak, rng, config
        self.stack = soak.stack
        self.submitted: dict[str, dict[str, Any]] = {}
        self.conflict_keys: dict[str, str] = {}
        self.items: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()
        self.done = 0
        self._deliveries: list[tuple[float, int, dict[str, Any], str]] = []
        self._seq = 0
        self._shared_version: dict[str, int] = {}
        deadline = config.seconds + config.max_wait + 600
        self.deadline_in = timedelta(seconds=min(3000.0, max(900.0, deadline)))
        kinds = list(MIX)
        self.plan = rng.choices(kinds, weights=[MIX[k] for k in kinds], k=config.actions)

    # --- envelopes ------------------------------------------------------------------------------
    def _envelope(self, action_type: str, arguments: dict[str, Any], target: dict[str, Any], *, tenant: str,
                  action_id: str, run_id: str, **extra: Any) -> Envelope:
        return self.stack.envelope(action_type, arguments=arguments, target=target, tenant=tenant,
                                   action_id=action_id, run_id=run_id, deadline_in=self.deadline_in, **extra)

    def ticket(self, i: int, tenant: str, action_id: str, run_id: str, title: str | None = None,
               **extra: Any) -> Envelope:
        return self._envelope("ticket.create", {"tenant": tenant, "title": title or f"soak item {i}", "owner": "ops"},
                              {"type": "ticket_queue", "id": f"{tenant}-q{i}"}, tenant=tenant, action_id=action_id,
                              run_id=run_id, **extra)

    def refund(self, i: int, tenant: str, action_id: str, run_id: str, account: str | None = None,
               amount: int | None = None, version: int = 1, **extra: Any) -> Envelope:
        if account is None:
            account = f"acct-{i}-{action_id}"
            sor.put_account(self.stack.sor_db, account, tenant, 100_000)
        amount = amount or self.rng.randint(100, 5000)
        return self._envelope("refund.issue", {"account": account, "tenant": tenant, "amount_cents": amount,
                                               "reason": "soak"},
                              {"type": "account", "id": account, "expected_version": version}, tenant=tenant,
                              action_id=action_id, run_id=run_id, **extra)

    def restart(self, i: int, tenant: str, action_id: str, run_id: str, service: str | None = None,
                generation: int = 1) -> Envelope:
        if service is None:
            service = f"svc-{i}-{action_id}"
            sor.put_service(self.stack.sor_db, service, tenant)
        return self._envelope("service.restart", {"service": service, "tenant": tenant,
                                                  "expected_generation": generation},
                              {"type": "service", "id": service, "expected_version": generation}, tenant=tenant,
                              action_id=action_id, run_id=run_id)

    def single(self, base: str, i: int, tenant: str, action_id: str) -> Envelope:
        run_id = f"run-{action_id}"
        if base == "ticket":
            return self.ticket(i, tenant, action_id, run_id)
        if base == "refund":
            return self.refund(i, tenant, action_id, run_id)
        return self.restart(i, tenant, action_id, run_id)

    # --- one item -------------------------------------------------------------------------------
    def submit(self, i: int) -> None:
        kind = self.plan[i]
        rng = self.rng
        tenant = rng.choice(TENANTS)
        aid = f"a{i:05d}-{kind}"
        self.items[kind] += 1
        if kind in ("ticket", "refund", "restart"):
            env = self.single(kind, i, tenant, aid)
            self._publish([env], kind)
        elif kind == "run2":
            run_id = f"r{i:05d}"
            steps = [self.ticket(i, tenant, f"{run_id}-s0", run_id, step=0, run_steps=2),
                     self.refund(i, tenant, f"{run_id}-s1", run_id, step=1, run_steps=2)]
            self._publish(steps, kind, run=True)
        elif kind == "duplicate":
            base = rng.choice(("ticket", "refund", "restart"))
            env = self.single(base, i, tenant, f"{aid}-{base}")
            message = self.stack.message(env)
            self._publish([env], kind)
            for _ in range(rng.randint(1, 2)):  # 2-3 deliveries of the same signed message in all
                self._later(rng.uniform(0.0, 4.0), message, "duplicate")
        elif kind == "conflict":
            base = rng.choice(("ticket", "refund"))
            aid = f"{aid}-{base}"
            run_id = f"run-{aid}"
            if base == "ticket":
                env = self.ticket(i, tenant, aid, run_id)
                other = self.ticket(i, tenant, aid, run_id, title=f"soak item {i} (changed)")
            else:
                account = f"acct-{i}-{aid}"
                sor.put_account(self.stack.sor_db, account, tenant, 100_000)
                amount = rng.randint(100, 5000)
                env = self.refund(i, tenant, aid, run_id, account=account, amount=amount)
                other = self.refund(i, tenant, aid, run_id, account=account, amount=amount + 777)
            assert other.idempotency_key != env.idempotency_key
            self.conflict_keys[other.idempotency_key] = aid
            self._publish([env], kind)
            self._later(rng.uniform(0.0, 3.0), self.stack.message(other), "conflict")
        else:  # shared: two actions approved against the same target version
            if rng.random() < 0.5:
                account = f"shared-acct-{rng.randrange(SHARED_TARGETS)}"
                owner = self._shared_tenant(account)
                if account not in self._shared_version:
                    sor.put_account(self.stack.sor_db, account, owner, 10_000_000)
                version = sor.get_account(self.stack.sor_db, account)["account"]["version"]
                self._shared_version[account] = version
                envs = [self.refund(i, owner, f"{aid}-{n}", f"run-{aid}-{n}", account=account, version=version)
                        for n in range(2)]
            else:
                service = f"shared-svc-{rng.randrange(SHARED_TARGETS)}"
                owner = self._shared_tenant(service)
                if service not in self._shared_version:
                    sor.put_service(self.stack.sor_db, service, owner)
                generation = sor.get_service(self.stack.sor_db, service)["generation"]
                self._shared_version[service] = generation
                envs = [self.restart(i, owner, f"{aid}-{n}", f"run-{aid}-{n}", service=service, generation=generation)
                        for n in range(2)]
            for env in envs:
                self._publish([env], kind)
        self.done += 1

    @staticmethod
    def _shared_tenant(name: str) -> str:
        return TENANTS[sum(name.encode()) % len(TENANTS)]

    # --- publishing -----------------------------------------------------------------------------
    def _ensure_conn(self) -> None:
        conn = self.stack.conn
        if conn.closed or conn.broken:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass
            self.stack.conn = store.connect(self.stack.urls["controller"], application_name="proofline-soak-controller",
                                            connect_timeout=10)
            self.counters["controller_reconnects"] += 1

    def _missing(self, envelopes: list[Envelope]) -> list[Envelope]:
        return [e for e in envelopes if self.stack.action(e.action_id) is None]

    def _publish(self, envelopes: list[Envelope], kind: str, run: bool = False) -> None:
        """Record and send, as a controller would. A failure before the ledger record is retried
        (the action does not exist yet); a failure after it is left to the runtime's reconciler."""
        pending = list(envelopes)
        for attempt in range(60):
            try:
                self._ensure_conn()
                if attempt:
                    pending = self._missing(envelopes)
                    if not pending:
                        break
                if not run:
                    for env in pending:
                        self.stack.publish(env)
                elif len(pending) == len(envelopes):
                    self.stack.publish_run(pending)
                else:
                    for env in pending:  # the rest of a run whose first step is recorded: held
                        self._publish_held(env)
                break
            except Exception as exc:  # noqa: BLE001 - the broker or the database is down: see above
                self.counters[f"publish_error:{type(exc).__name__}"] += 1
                time.sleep(0.3)
        else:
            # The controller itself could not record the action: it was never published, so it is
            # nobody's to lose. Counted, and left out of the checks.
            self.counters["publish_gave_up"] += 1
            try:
                self._ensure_conn()
                envelopes = [e for e in envelopes if e not in self._missing(envelopes)]
            except Exception:  # noqa: BLE001
                envelopes = []
        for env in envelopes:
            self.submitted[env.action_id] = {"kind": kind, "key": env.idempotency_key, "type": env.action_type}
        self.counters["published"] += len(envelopes)

    def _publish_held(self, env: Envelope) -> None:
        from proofline.controller import publish

        publish(self.stack.settings, self.stack.conn, self.stack.app, env, hold=env.step > 0)

    def _later(self, after: float, message: dict[str, Any], what: str) -> None:
        self._seq += 1
        heapq.heappush(self._deliveries, (time.monotonic() + after, self._seq, message, what))

    def deliver_due(self, final: bool = False) -> None:
        """Send the duplicate and conflicting deliveries that are due (all of them with ``final``)."""
        while self._deliveries:
            due, _seq, message, what = self._deliveries[0]
            if due > time.monotonic():
                if not final:
                    return
                time.sleep(min(0.05, due - time.monotonic()))
                continue
            heapq.heappop(self._deliveries)
            for _attempt in range(10):
                try:
                    self.stack.deliver(message)
                    self.counters[f"{what}_deliveries"] += 1
                    break
                except Exception:  # noqa: BLE001 - the broker is down: a sender would try again
                    time.sleep(0.5)
            else:
                self.counters[f"{what}_deliveries_lost"] += 1

    def run(self, seconds: float, stop: threading.Event) -> None:
        """Submit every item, evenly spaced over ``seconds``."""
        interval = seconds / max(1, self.config.actions)
        start = time.monotonic()
        for i in range(self.config.actions):
            due = start + i * interval
            while not stop.is_set() and time.monotonic() < due:
                self.deliver_due()
                time.sleep(min(0.02, max(0.0, due - time.monotonic())))
            if stop.is_set():
                return
            self.submit(i)
            self.deliver_due()
        self.deliver_due(final=True)


# --- progress --------------------------------------------------------------------------------------
class Progress:
    """One ``\\r``-updated status line on stderr."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.text = ""
        self._width = 0

    def show(self, text: str) -> None:
        if not self.enabled:
            return
        pad = max(0, self._width - len(text))
        sys.stderr.write("\r" + text + " " * pad)
        sys.stderr.flush()
        self._width = len(text)

    def done(self) -> None:
        if self.enabled and self._width:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._width = 0


def _bar(fraction: float, width: int = 20) -> str:
    filled = int(max(0.0, min(1.0, fraction)) * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


class Monitor(threading.Thread):
    """Refreshes the progress line while items are submitted and faults injected."""

    def __init__(self, soak: soak_stack.SoakStack, workload: Workload, faults: FaultInjector, config: SoakConfig,
                 progress: Progress, t0: float) -> None:
        super().__init__(name="soak-progress", daemon=True)
        self.soak, self.workload, self.faults, self.config, self.progress, self.t0 = (
            soak, workload, faults, config, progress, t0)
        self.stop_event = threading.Event()
        self.open_actions = 0

    def run(self) -> None:
        conn = None
        while not self.stop_event.wait(0.5):
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = self.soak.admin_connect()
                self.open_actions = len(unsettled(conn))
            except Exception:  # noqa: BLE001 - only a progress figure
                conn = None
            elapsed = time.monotonic() - self.t0
            kinds, frozen = self.faults.snapshot()
            active = ",".join(kinds)
            self.progress.show(
                f"soak seed={self.config.seed} {_bar(elapsed / self.config.seconds)} {elapsed:5.1f}/"
                f"{self.config.seconds:g}s | items {self.workload.done}/{self.config.actions} | open {self.open_actions}"
                f" | faults {len(self.faults.records)}" + (f" (now: {active})" if active else "")
                + (f" frozen {frozen}" if frozen else ""))
        if conn is not None:
            conn.close()


# --- the soak ---------------------------------------------------------------------------------------
def run_soak(config: SoakConfig) -> SoakResult:
    """Run one soak; never raises for an invariant (see ``SoakResult.ok``); always tears down."""
    result = SoakResult(config)
    progress = Progress(config.progress)
    own_workdir = config.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix=f"proofline-soak-{config.seed}-")) if own_workdir else config.workdir
    assert workdir is not None
    result.workdir = str(workdir)
    keep_db = config.keep_database or bool(os.environ.get("PROOFLINE_TEST_KEEP_DATABASES"))
    soak: soak_stack.SoakStack | None = None
    injector: FaultInjector | None = None
    monitor: Monitor | None = None
    stop = threading.Event()
    t_build = time.monotonic()
    try:
        progress.show(f"soak seed={config.seed}: starting {config.broker}, system of record, proxy, database, "
                      "workers ...")
        soak = soak_stack.build(workdir, workers=config.workers, concurrency=config.concurrency,
                                private_postgres=config.on_private_postgres, broker=config.broker)
        assert soak.stack is not None
        result.database_url = soak.stack.database_url
        result.durations["build_seconds"] = round(time.monotonic() - t_build, 2)
        workload = Workload(soak, random.Random(f"workload-{config.seed}"), config)
        t0 = time.monotonic()
        injector = FaultInjector(soak, random.Random(config.seed), config.seconds, t0, kinds=config.faults,
                                 gap=config.fault_gap).start()
        monitor = Monitor(soak, workload, injector, config, progress, t0)
        monitor.start()
        try:
            workload.run(config.seconds * config.submit_fraction, stop)
            result.durations["submit_seconds"] = round(time.monotonic() - t0, 2)
            injector.join()
        finally:
            monitor.stop_event.set()
            monitor.join(5)
            result.heal_problems = injector.heal_all()
            if injector.thread_error:
                result.heal_problems.append(f"injector thread: {injector.thread_error}")
            result.faults = [r.as_dict() for r in injector.records]
            result.faults_by_kind = dict(Counter(r.kind for r in injector.records if not r.error))
            failed = Counter(r.kind for r in injector.records if r.error)
            if failed:
                result.faults_by_kind.update({f"{k} (not injected)": n for k, n in failed.items()})
            result.items = dict(workload.items)
            result.controller = dict(workload.counters)
            result.submitted_actions = len(workload.submitted)
        result.durations["fault_window_seconds"] = round(time.monotonic() - t0, 2)
        progress.done()

        def on_poll(n: int, waited: float) -> None:
            progress.show(f"soak seed={config.seed}: healed; waiting for quiet {_bar(waited / config.max_wait)} "
                          f"{waited:5.1f}/{config.max_wait:g}s | open {n}")

        quiet: Quiet = wait_quiet(soak.admin_connect, quiet_seconds=config.quiet_seconds, max_wait=config.max_wait,
                                  on_poll=on_poll)
        progress.done()
        result.quiet = {"reached": quiet.reached, "seconds_to_quiet": quiet.seconds,
                        "still_open": quiet.still_open[:50]}
        result.stats["workers_alive"] = [p.poll() is None for p in soak.stack.workers]
        result.stats["worker_restarts"] = _worker_restarts(workdir)
        with soak.admin_connect() as conn:
            checked: CheckResult = check(conn, soak.stack.sor_db, workload.submitted, workload.conflict_keys)
        result.stats.update(checked.stats)
        result.violations = [v.as_dict() for v in checked.violations]
        result.ok = checked.ok and not result.heal_problems
        if result.heal_problems:
            result.error = "healing failed: " + "; ".join(result.heal_problems)
    except KeyboardInterrupt:
        stop.set()
        result.error = "interrupted"
        raise
    except Exception as exc:  # noqa: BLE001 - reported in the result; the caller exits non-zero
        result.error = f"{type(exc).__name__}: {exc}"
        result.ok = False
    finally:
        stop.set()
        progress.done()
        if injector is not None and injector.running:
            injector.heal_all()
        if soak is not None:
            soak.teardown(keep_database=keep_db or (config.keep_failed and not result.ok))
        result.durations["total_seconds"] = round(time.monotonic() - t_build, 2)
        if own_workdir and result.ok:
            shutil.rmtree(workdir, ignore_errors=True)
        if config.json_path is not None:
            config.json_path.write_text(json.dumps(result.as_dict(), indent=2, default=str))
    return result


def _worker_restarts(workdir: Path) -> dict[str, int]:
    """What the worker logs say about Celery main processes that died under their supervisor."""
    counts: Counter[str] = Counter()
    for log in sorted(workdir.glob("worker-*.log")):
        text = log.read_text(errors="replace")
        counts["restarted_by_supervisor"] += text.count("proofline: worker exited")
        counts["celery_unrecoverable_errors"] += text.count("Unrecoverable error")
    return dict(counts)


# --- the report ----------------------------------------------------------------------------------
def summary(result: SoakResult) -> str:
    c, s = result.config, result.stats
    lines: list[str] = []

    def row(label: str, value: Any) -> None:
        lines.append(f"  {label:<52} {value}")

    lines.append(f"Proofline soak  seed {c.seed}  items {c.actions}  faults {c.seconds:g}s  workers {c.workers}x"
                 f"{c.concurrency}  broker {c.broker}")
    lines.append("-" * 86)
    row("work items", ", ".join(f"{k} {v}" for k, v in sorted(result.items.items())) or "-")
    row("actions published by the soak", result.submitted_actions)
    row("actions in the ledger (with compensations)", s.get("ledger_actions", "-"))
    row("  by kind", ", ".join(f"{k} {v}" for k, v in sorted(s.get("by_kind", {}).items())) or "-")
    row("controller", ", ".join(f"{k} {v}" for k, v in sorted(result.controller.items())) or "-")
    row("faults injected", sum(v for k, v in result.faults_by_kind.items() if "not injected" not in k))
    for kind, n in sorted(result.faults_by_kind.items()):
        row(f"  {kind}", n)
    lines.append("  outcomes (status/outcome)")
    for key, n in sorted(s.get("by_status_outcome", {}).items(), key=lambda kv: -kv[1]):
        row(f"    {key}", n)
    lines.append("  outcomes by action type")
    for key, n in sorted(s.get("by_type_outcome", {}).items()):
        row(f"    {key}", n)
    row("reason codes", ", ".join(f"{k} {v}" for k, v in sorted(s.get("reason_codes", {}).items(),
                                                               key=lambda kv: -kv[1])) or "-")
    row("runtime events", ", ".join(f"{k} {v}" for k, v in sorted(s.get("event_counts", {}).items())) or "-")
    restarts = s.get("worker_restarts", {})
    row("Celery worker deaths (unrecoverable) / supervisor restarts",
        f"{restarts.get('celery_unrecoverable_errors', '-')} / {restarts.get('restarted_by_supervisor', '-')}")
    row("kill switches left engaged", len(s.get("kill_switches_active", [])))
    row("effects in the system of record (with key)", f"{s.get('effects', '-')} ({s.get('effects_with_key', '-')})")
    offending = result.offending()
    row("conflicting deliveries refused on the original's chain",
        f"{s.get('conflicts_recorded', '-')} of {result.items.get('conflict', 0)}")
    row("duplicates (keys with > 1 effect)", s.get("keys_with_more_than_one_effect", "-"))
    row("lost", len(offending.get("nothing_lost", [])))
    row("unexplained", len(offending.get("nothing_unexplained", [])))
    q = result.quiet
    row("time to quiet after healing", f"{q.get('seconds_to_quiet', '-')} s" + ("" if q.get("reached", True)
                                                                                  else " (NOT QUIET)"))
    row("hash chains / events", f"{s.get('chains', '-')} / {s.get('events', '-')}")
    row("advisory locks held / open leases", f"{s.get('advisory_locks', '-')} / {s.get('open_leases', '-')}")
    lines.append("-" * 86)
    for name in INVARIANTS:
        ids = offending.get(name, [])
        lines.append(f"  {'PASS' if not ids else 'FAIL'}  {name}" + (f"  ({len(ids)}): {', '.join(ids[:15])}"
                                                                     + (" ..." if len(ids) > 15 else "") if ids else ""))
    if result.error:
        lines.append(f"  ERROR {result.error}")
    lines.append(("OK" if result.ok else "FAILED") + f"  ({result.durations.get('total_seconds', '-')} s in all)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--actions", type=int, default=200, help="work items to submit")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the fault window")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2, help="prefork processes per worker")
    parser.add_argument("--broker", choices=soak_stack.BROKERS, default="redis",
                        help="the soak's own Redis, or its own three-node RabbitMQ cluster")
    parser.add_argument("--json", type=Path, default=None, help="write the full result here")
    parser.add_argument("--max-wait", type=float, default=240.0, help="longest wait for quiet after healing")
    parser.add_argument("--quiet-seconds", type=float, default=10.0)
    parser.add_argument("--submit-fraction", type=float, default=0.7)
    parser.add_argument("--faults", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--workdir", type=Path, default=None, help="logs and the SQLite record (default: a temp dir)")
    parser.add_argument("--keep-database", action="store_true", help="keep the ledger database for forensics")
    parser.add_argument("--keep-failed", action="store_true", help="keep the ledger database if the soak fails")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.actions < 1 or args.seconds <= 0 or not 0 < args.submit_fraction <= 1:
        parser.error("--actions and --seconds must be positive, --submit-fraction in (0, 1]")
    faults = tuple(f for f in args.faults.split(",") if f)
    config = SoakConfig(actions=args.actions, seconds=args.seconds, seed=args.seed, workers=args.workers,
                        concurrency=args.concurrency, broker=args.broker, submit_fraction=args.submit_fraction,
                        quiet_seconds=args.quiet_seconds, max_wait=args.max_wait, faults=faults,
                        json_path=args.json, workdir=args.workdir, keep_database=args.keep_database,
                        keep_failed=args.keep_failed,
                        progress=not args.no_progress)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        result = run_soak(config)
    except KeyboardInterrupt:
        print("\ninterrupted; everything the soak started was stopped", file=sys.stderr)
        return 130
    print(summary(result))
    if not result.ok:
        print(result.failure_text(), file=sys.stderr)
        print(f"logs: {result.workdir}", file=sys.stderr)
        if config.keep_database or config.keep_failed or os.environ.get("PROOFLINE_TEST_KEEP_DATABASES"):
            print(f"ledger kept: PROOFLINE_DATABASE_URL={result.database_url} python -m proofline forensics <action_id>",
                  file=sys.stderr)
        else:
            print("keep the ledger for forensics with PROOFLINE_TEST_KEEP_DATABASES=1 (or --keep-database)",
                  file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
