"""Throughput and cost of the full Proofline path against bare-Celery baselines, in one run.

    .venv/bin/python -m ops.bench [--actions N] [--transport http] [--json PATH]
    .venv/bin/python -m ops.bench --servers FILE --contracts DIR --action-type TYPE \
        --arguments '{"query": "... {n} ..."}' --target '{"type": "order", "id": "{n}"}'

The second form runs against servers you did not write: stdio identities of FILE are put behind
the witness relay (a copy of FILE next to it, removed at the end), so MCP requests are counted on
the wire; HTTP servers of FILE are not relayed. ``{n}`` is unique across the run (each template
fill is one envelope), so a target the action changes is never reused.

What it does, in order:

1. builds a stack (``tests.conftest.build_stack``): a migrated Postgres database, a Redis database,
   the system-of-record MCP server (writer and reader identities) and one Proofline worker with two
   prefork processes;
2. warms the full path up (``--warmup`` actions, excluded from every figure);
3. runs the **baselines** (``ops.baseline_tasks``): bare Celery tasks, no durability, against the
   same server, their own worker with two prefork processes on their own Redis database: first the
   same two MCP calls as before (demo server only), then the **same MCP requests the runtime makes
   per action** (precondition read, write, verification read, arguments built from the contract).
   They run while the ledger database is idle, which also lets Postgres flush the warm-up's
   statistics (see "Commits" below);
4. runs the **full path**: publishes N envelopes through the SDK's batched path (``publish_many``,
   ``--batch`` per ledger transaction, then the signed messages), waits until every one is settled,
   then stops the worker so that Postgres flushes its statistics, and reads the figures; MCP
   requests per action are the witness relays' records over the window (``tools/call`` and every
   other request, ``tools/list`` included): measured on the wire, not computed;
5. runs the **open loop** (``--open-loop-actions``): a fresh warmed worker, actions published one by
   one at half the saturation throughput of step 4 (or ``--rate``), p50/p99 publish -> final state;
6. runs an **accounting pass** (``--accounting-actions``, default 50) with a fresh worker whose
   database connections go through a counting wire-protocol proxy (``ops.pgwire``), to count
   statements, round trips and transactions per action exactly (``pg_stat_statements`` is not
   loaded on this server; loading it needs a restart). The proxy adds latency and CPU, so it is
   kept out of the timed window;
7. prints the table and the targets, optionally writes JSON (headline figures flat at the top level:
   ``actions_per_s_full``, ``actions_per_s_bare_same_calls``, ``ratio_same_calls``,
   ``commits_per_action``, ``worker_round_trips_per_action``, ``mcp_requests_per_action``,
   ``cpu_ms_per_action_all``, ``p99_ms_half_load``, ...), and tears everything down.

Figures
-------
- actions/s: verified actions / (last ``final_state`` ``at`` - first ``published`` ``at``), both
  ledger timestamps (database clock). Baseline: tasks / (last completion - first publish).
- latency: per action, ``final_state.at - published.at`` from ``ledger_events``.
- CPU-ms per action: user+system CPU of the worker's process tree (Celery main process and pool
  children, via psutil), delta over the window, divided by N. Also shown: the MCP servers, the
  Postgres backends of the bench database, Redis and the bench process itself (controller side).

Commits (how they are counted)
------------------------------
- ``pg_stat_database.xact_commit`` for the bench database, read from a connection to the
  ``postgres`` database (so reading it adds nothing). Postgres 15 backends flush their counters at
  most once a second, and an idle backend may hold them up to 10 s, so: the start value is read
  more than 10.5 s after the warm-up went quiet; the end value is read after the worker, the
  controller connection and the bench's probe connection have closed (a backend flushes on exit).
  The delta therefore covers exactly the timed window. It counts every top-level transaction,
  read-only autocommit statements included, from every client: the controller's ``published``
  transaction (one per action), the worker's, new connections (each runs one internal
  transaction), autovacuum, and the bench's own completion checks, which are counted and removed.
- write transactions: (a) distinct ``xmin`` over the ``ledger_events`` rows of the measured actions.
  Every write transaction on the happy path appends at least one event, the table is insert-only,
  and a row's ``xmin`` is the id of the transaction that inserted it; this reads no counter and
  nothing else can inflate it. (b) the growth of ``pg_snapshot_xmax(pg_current_snapshot())`` over
  the window (reading a snapshot assigns no transaction id), which is cluster-wide: any other
  database's writes on this server land in it too.
- the accounting pass counts transactions on the wire per client role (ReadyForQuery status).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import psycopg
import redis
from celery import Celery
from psycopg.rows import dict_row

from ledger import store
from ops import baseline_tasks
from ops.pgwire import CountingProxy, Counts, per_role_delta
from proofline.contracts import contract_for
from proofline.controller import describe_server, publish_many
from proofline.settings import ROOT, Settings, get_settings
from proofline.shards import sharded_queues
from proofline_kit.resources import CLAIM_KEY, claim_redis_db, redis_url, release_redis_db
from proofline_kit.witness import WitnessLog
from proofline_kit.witness.placement import witness_stdio_servers
from tests.conftest import (
    ADMIN_URL,
    Stack,
    build_stack,
    start_process,
    start_workers,
    stop_process,
    teardown_stack,
    wait_for,
)
from worker.dispatch import CeleryDispatch

DEFAULT_ARGUMENTS = {"tenant": "acme", "title": "bench {label} {i}", "owner": "ops"}
DEFAULT_TARGET = {"type": "ticket_queue", "id": "acme-{queue}"}
TARGET_COMMITS = 3.0
TARGET_RATIO_SAME_CALLS = 0.6
TARGET_ROUND_TRIPS = 10
TARGET_P99_MS = 50.0
TARGET_MCP_CALLS = 3
#: Postgres 15 holds an idle backend's pending statistics for up to PGSTAT_IDLE_INTERVAL (10 s).
STATS_FLUSH_SECONDS = 10.5
#: kombu's Redis transport keeps priorities 3, 6 and 9 in lists suffixed with "\x06\x16<n>".
PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")
# Every queue the full path uses, the tenant shards of ``actions`` and ``verify`` included.
FULL_QUEUES = (*sharded_queues("actions", get_settings().tenant_shards),
               *sharded_queues("verify", get_settings().tenant_shards), "compensate", "recovery")
CONTROLLER_APP = "proofline-bench-controller"
#: Settings the test stack shortens so tests see leases lapse and the reconciler act within seconds.
#: The bench puts them back to the runtime's defaults unless --test-timings is given: with a
#: 3-second re-drive, any backlog longer than that is re-sent and measured as duplicate work.
TEST_TIMINGS = {
    "PROOFLINE_LEASE_TTL_SECONDS": "lease_ttl_seconds",
    "PROOFLINE_HEARTBEAT_SECONDS": "heartbeat_seconds",
    "PROOFLINE_PROGRESS_EVENTS_LIMIT": "progress_events_limit",
    "PROOFLINE_RECONCILE_INTERVAL_SECONDS": "reconcile_interval_seconds",
    "PROOFLINE_REDRIVE_AFTER_SECONDS": "redrive_after_seconds",
    "PROOFLINE_VERIFY_STALL_SECONDS": "verify_stall_seconds",
}


# --- small helpers ------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def filled(template: Any, values: dict[str, str]) -> Any:
    """``template`` (JSON) with ``{n}``, ``{i}``, ``{run}``, ``{label}`` and ``{queue}`` in its strings filled in."""
    if isinstance(template, str):
        for name, value in values.items():
            template = template.replace("{" + name + "}", value)
        return template
    if isinstance(template, dict):
        return {k: filled(v, values) for k, v in template.items()}
    if isinstance(template, list):
        return [filled(v, values) for v in template]
    return template


def mcp_requests(witness: WitnessLog | None, mark: int, n: int) -> dict[str, Any]:
    """MCP requests the servers received since ``mark``, per action, as the witness relays counted
    them on the wire (every ``tools/call``, ``tools/list`` and other request); None without relays."""
    if witness is None or not witness.path.exists():
        return {"per_action": None, "tools_list_per_action": None, "by_method": {}}
    by_method: dict[str, int] = {"tools/call": witness.count(since=mark)}
    for record in witness.requests(since=mark):
        by_method[record["method"]] = by_method.get(record["method"], 0) + 1
    return {"per_action": per(sum(by_method.values()), n), "tools_list_per_action": per(by_method.get("tools/list", 0), n),
            "by_method": by_method}


def per(value: float | None, n: int) -> float | None:
    return None if value is None or n <= 0 else value / n


def clear_except_claim(client: redis.Redis) -> None:
    """Empty a claimed database but for its claim (what a previous baseline left behind)."""
    keys = [k for k in client.scan_iter(count=1000) if k != CLAIM_KEY.encode()]
    if keys:
        client.delete(*keys)


def with_port(url: str, port: int) -> str:
    """``url`` pointing at 127.0.0.1:``port``, TLS off (the counting proxy cannot read TLS)."""
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    return f"{parts.scheme}://{user}127.0.0.1:{port}{parts.path}?sslmode=disable&gssencmode=disable"


# --- CPU accounting ---------------------------------------------------------------------------------


def window_arguments(description: str, transport: str) -> argparse.ArgumentParser:
    """The options of a bench that compares two sides in alternating windows of one run."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--actions", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--transport", choices=("http", "stdio"), default=transport)
    parser.add_argument("--json", type=Path, default=None)
    return parser


def runtime_defaults() -> dict[str, str]:
    """The runtime's own defaults for the settings the test stack shortens (those that exist)."""
    fields = Settings.model_fields
    return {env: str(fields[name].default) for env, name in TEST_TIMINGS.items()
            if name in fields and fields[name].default is not None}


def source_state() -> str:
    """The commit the run measured, and whether the work tree differed from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head}{f' + {len(dirty)} modified files' if dirty else ''}"


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def cpu_seconds(procs: Iterable[psutil.Process]) -> dict[int, float]:
    """user+system CPU of each live process, by pid."""
    out: dict[int, float] = {}
    for proc in procs:
        try:
            t = proc.cpu_times()
            out[proc.pid] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU spent between two samples; a process born in between counts from zero."""
    return sum(v - before.get(pid, 0.0) for pid, v in after.items())


def redis_server_pids() -> list[int]:
    pids = []
    for proc in psutil.process_iter(["name"]):
        if (proc.info.get("name") or "").startswith("redis-server"):
            pids.append(proc.pid)
    return pids


def machine_busy_seconds() -> float:
    """CPU time the whole machine spent not idle (all processes, all cores)."""
    t = psutil.cpu_times()
    return sum(getattr(t, name) for name in t._fields if name not in ("idle", "iowait", "guest", "guest_nice"))


def foreign_load(busy0: float, busy1: float, ours_ms: float, seconds: float) -> dict[str, float]:
    """CPU used outside the measured processes during a window (other users of this machine)."""
    other = max(0.0, (busy1 - busy0) - ours_ms / 1000)
    return {"other_cpu_seconds": other, "other_share_of_machine": other / (seconds * (os.cpu_count() or 1))}


@dataclass
class CpuGroups:
    """Named groups of processes whose CPU is sampled together."""

    groups: dict[str, Callable[[], list[psutil.Process]]]

    def sample(self) -> dict[str, dict[int, float]]:
        return {name: cpu_seconds(procs()) for name, procs in self.groups.items()}

    @staticmethod
    def delta_ms(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]) -> dict[str, float]:
        return {name: cpu_delta(before.get(name, {}), after[name]) * 1000 for name in after}


# --- the bench ------------------------------------------------------------------------------------


@dataclass
class Bench:
    args: argparse.Namespace
    stack: Stack
    admin: psycopg.Connection  # to the "postgres" database: statistics, activity, xids
    dbname: str
    probe_queries: int = 0
    baseline_proc: Any = None
    proxy: CountingProxy | None = None
    results: dict[str, Any] = field(default_factory=dict)
    approved_live: tuple[str | None, dict[str, str]] | None = None
    #: Envelopes made so far (``{n}`` in the templates: unique across the whole run).
    serial: int = 0

    # --- database probes -----------------------------------------------------------------------
    def pg_stats(self) -> dict[str, int]:
        row = self.admin.execute(
            "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted, blks_read, blks_hit "
            "FROM pg_stat_database WHERE datname = %s", (self.dbname,)).fetchone()
        return dict(row)

    def xid_horizon(self) -> int:
        return int(self.admin.execute(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS x").fetchone()["x"])

    def maintenance_runs(self, conn: psycopg.Connection) -> int:
        """Autovacuum and autoanalyze runs so far in the bench database (each is a transaction there)."""
        row = conn.execute("SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0)::int AS n "
                           "FROM pg_stat_user_tables").fetchone()
        return int(row["n"])

    def backend_pids(self) -> list[int]:
        rows = self.admin.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                                  (self.dbname,)).fetchall()
        return [r["pid"] for r in rows]

    def wait_no_backends(self, timeout: float = 15.0) -> None:
        wait_for(lambda: not self.backend_pids(), timeout, 0.05, what="bench database backends to exit")

    def connect_probe(self) -> psycopg.Connection:
        return psycopg.connect(self.stack.admin_url, autocommit=True, row_factory=dict_row,
                               application_name="proofline-bench-probe")

    # --- Redis -----------------------------------------------------------------------------------
    def broker_pending(self, client: redis.Redis) -> int:
        pipe = client.pipeline(transaction=False)
        for queue in FULL_QUEUES:
            for suffix in PRIORITY_SUFFIXES:
                pipe.llen(queue + suffix)
        pipe.hlen("unacked")
        return sum(pipe.execute())

    def wait_full_path(self, action_ids: list[str], probe: psycopg.Connection, timeout: float, worker: Any) -> float:
        """Wait until the broker holds nothing for the workers and every action is settled.

        The broker is polled first (no database statement); the ledger is then read once to
        confirm (and again only if something is still moving). Returns the monotonic time it ended.
        """
        client = redis.Redis.from_url(self.stack.broker_url)
        deadline = time.monotonic() + timeout
        quiet_since: float | None = None
        last_pending, moved_at = -1, time.monotonic()
        while True:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"{len(action_ids)} actions did not settle within {timeout:.0f}s")
            if worker.poll() is not None:
                raise RuntimeError("the Proofline worker exited; see its log in the work directory")
            pending = self.broker_pending(client)
            if pending != last_pending:
                last_pending, moved_at = pending, now
            elif pending and now - moved_at > self.args.stall_seconds:
                raise TimeoutError(f"no progress for {self.args.stall_seconds:.0f}s with {pending} messages "
                                   "pending (is the worker failing? see its log in the work directory)")
            if pending == 0:
                quiet_since = quiet_since or now
                if now - quiet_since >= 0.1:
                    self.probe_queries += 1
                    row = probe.execute(
                        "SELECT count(*) AS n FROM actions WHERE action_id = ANY(%s) "
                        "AND status IN ('closed', 'escalated', 'recovery')", (action_ids,)).fetchone()
                    if row["n"] == len(action_ids):
                        client.close()
                        return time.monotonic()
                    quiet_since = None
                    time.sleep(0.2)
            else:
                quiet_since = None
            time.sleep(0.01)

    # --- full path ------------------------------------------------------------------------------
    def live(self) -> tuple[str | None, dict[str, str]]:
        """The live server version and tool hashes the controller approves against (listed once)."""
        if self.approved_live is None:
            server = contract_for(self.stack.settings.contracts_dir, self.args.action_type).server
            self.approved_live = describe_server(self.stack.settings, server)
            self.stack._live = self.approved_live  # what Stack.envelope approves against otherwise lists "sor"
        return self.approved_live

    def envelopes(self, count: int, label: str) -> list[Any]:
        run = uuid.uuid4().hex[:8]
        out = []
        for i in range(count):
            queue = f"{label}-{run}-{i}" if self.args.targets <= 0 else f"q{i % self.args.targets}"
            self.serial += 1
            fill = {"i": str(i), "n": str(self.serial), "run": run, "label": label, "queue": queue}
            out.append(self.stack.envelope(
                self.args.action_type, arguments=filled(self.args.arguments, fill),
                target=filled(self.args.target, fill), tenant=self.args.tenant, live=self.live()))
        return out

    def publish_all(self, envelopes: list[Any]) -> tuple[float, float]:
        """Publish through the SDK's batched path: one ledger transaction per ``--batch`` envelopes."""
        started = time.monotonic()
        dispatch = CeleryDispatch(self.stack.app, self.stack.settings.tenant_shards)
        for at in range(0, len(envelopes), self.args.batch):
            publish_many(self.stack.settings, self.stack.conn, dispatch, envelopes[at:at + self.args.batch])
        return started, time.monotonic()

    def warm_full(self, probe: psycopg.Connection, worker: Any) -> None:
        envs = self.envelopes(self.args.warmup, "warm")
        self.publish_all(envs)
        self.wait_full_path([e.action_id for e in envs], probe, timeout=90, worker=worker)

    def full_cpu_groups(self, worker_pid: int) -> CpuGroups:
        stack = self.stack
        pg_pids = self.backend_pids()
        return CpuGroups({
            "worker": lambda: process_tree(worker_pid),
            "mcp_servers": lambda: [p for proc in stack.processes for p in process_tree(proc.pid)],
            "postgres_backends": lambda: [p for pid in sorted(set(pg_pids) | set(self.backend_pids()))
                                          for p in process_tree(pid)],
            "redis": lambda: [p for pid in redis_server_pids() for p in process_tree(pid)],
            "bench": lambda: [psutil.Process()],
        })

    def run_full(self, worker: Any, probe: psycopg.Connection, quiet_since: float) -> dict[str, Any]:
        args, stack = self.args, self.stack
        n = args.actions
        envs = self.envelopes(n, "run")
        ids = [e.action_id for e in envs]
        # The warm-up's statistics must have reached pg_stat_database before the start value is read.
        remaining = quiet_since + STATS_FLUSH_SECONDS - time.monotonic()
        if remaining > 0:
            log(f"waiting {remaining:.1f}s for Postgres to flush the warm-up's statistics")
            time.sleep(remaining)
        groups = self.full_cpu_groups(worker.pid)
        stats0, xid0, probes0 = self.pg_stats(), self.xid_horizon(), self.probe_queries
        maintenance0 = self.maintenance_runs(probe)
        self.probe_queries += 1  # that read is a transaction in the window too
        mark = stack.witness.mark() if stack.witness else 0
        cpu0, busy0 = groups.sample(), machine_busy_seconds()
        log(f"full path: publishing {n} {args.action_type} actions")
        t_pub0, t_pub1 = self.publish_all(envs)
        t_done = self.wait_full_path(ids, probe, timeout=60 + n * 0.5, worker=worker)
        cpu1, busy1 = groups.sample(), machine_busy_seconds()
        mcp = mcp_requests(stack.witness, mark, n)
        probes = self.probe_queries - probes0
        xid1 = self.xid_horizon()
        # Stop everything that talks to the bench database so its counters are flushed (on exit).
        stop_process(worker)
        stack.conn.close()
        probe.close()
        self.wait_no_backends()
        stats1 = self.pg_stats()
        log(f"full path: {n} settled in {t_done - t_pub0:.1f}s (publishing took {t_pub1 - t_pub0:.1f}s)")

        with self.connect_probe() as conn:
            maintenance = self.maintenance_runs(conn) - maintenance0
            outcomes = conn.execute(
                "SELECT status::text, outcome::text, count(*) AS n FROM actions WHERE action_id = ANY(%s) "
                "GROUP BY 1, 2 ORDER BY 3 DESC", (ids,)).fetchall()
            timing = conn.execute(
                """SELECT p.action_id, extract(epoch FROM p.at)::float8 AS published,
                          extract(epoch FROM f.at)::float8 AS verified
                   FROM ledger_events p
                   JOIN ledger_events f ON f.action_id = p.action_id AND f.event = 'final_state'
                   WHERE p.event = 'published' AND p.action_id = ANY(%s)""", (ids,)).fetchall()
            xmins = conn.execute(
                """SELECT count(DISTINCT xmin::text) AS all_txns,
                          count(DISTINCT xmin::text) FILTER (WHERE event <> 'published') AS worker_txns,
                          count(*) AS events
                   FROM ledger_events WHERE action_id = ANY(%s)""", (ids,)).fetchone()
            leases = conn.execute(
                """SELECT count(*) FILTER (WHERE heartbeat_at > acquired_at + interval '0.5 s') AS heartbeats,
                          percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM released_at - acquired_at))
                              * 1000 AS held_ms_p50
                   FROM leases WHERE action_id = ANY(%s)""", (ids,)).fetchone()
            stages = conn.execute(
                """WITH e AS (SELECT action_id, event, extract(epoch FROM at) AS t FROM ledger_events
                              WHERE action_id = ANY(%s) AND event IN
                                ('published', 'validated', 'tool_called', 'final_state')),
                        p AS (SELECT action_id, max(t) FILTER (WHERE event = 'published') AS published,
                                     max(t) FILTER (WHERE event = 'validated') AS validated,
                                     max(t) FILTER (WHERE event = 'tool_called') AS called,
                                     max(t) FILTER (WHERE event = 'final_state') AS final
                              FROM e GROUP BY action_id)
                   SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY validated - published) * 1000
                              AS queue_to_execute_ms,
                          percentile_cont(0.5) WITHIN GROUP (ORDER BY called - validated) * 1000
                              AS execute_to_tool_called_ms,
                          percentile_cont(0.5) WITHIN GROUP (ORDER BY final - called) * 1000
                              AS tool_called_to_verified_ms
                   FROM p""", (ids,)).fetchone()
            calls = conn.execute(
                """SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY (evidence->>'elapsed_ms')::float8) AS p50,
                          percentile_cont(0.99) WITHIN GROUP (ORDER BY (evidence->>'elapsed_ms')::float8) AS p99
                   FROM ledger_events WHERE action_id = ANY(%s) AND event = 'tool_called'""", (ids,)).fetchone()
            events = conn.execute(
                "SELECT event, count(*) AS n FROM ledger_events WHERE action_id = ANY(%s) GROUP BY 1 ORDER BY 2 DESC",
                (ids,)).fetchall()

        latencies_ms = [(r["verified"] - r["published"]) * 1000 for r in timing]
        window = (max(r["verified"] for r in timing) - min(r["published"] for r in timing)) if timing else None
        cpu_ms = CpuGroups.delta_ms(cpu0, cpu1)
        commits = stats1["xact_commit"] - stats0["xact_commit"]
        rollbacks = stats1["xact_rollback"] - stats0["xact_rollback"]
        closed_verified = sum(r["n"] for r in outcomes if r["status"] == "closed" and r["outcome"] == "completed_verified")
        db_commits = commits - probes  # the bench's own completion checks are autocommit reads
        return {
            "actions": n,
            "verified": closed_verified,
            "outcomes": [dict(r) for r in outcomes],
            "actions_per_second": per(len(timing), window) if window else None,
            "window_seconds": window,
            "publish_seconds": t_pub1 - t_pub0,
            "wall_seconds_to_settled": t_done - t_pub0,
            "latency_ms": {"p50": percentile(latencies_ms, 50), "p95": percentile(latencies_ms, 95),
                           "p99": percentile(latencies_ms, 99), "max": max(latencies_ms, default=None)},
            "cpu_ms": cpu_ms,
            "cpu_ms_per_action": {k: per(v, n) for k, v in cpu_ms.items()},
            "cpu_ms_per_action_all": per(sum(cpu_ms.values()), n),
            "foreign_load": foreign_load(busy0, busy1, sum(cpu_ms.values()), t_done - t_pub0),
            "pg_stat_database": {"before": stats0, "after": stats1},
            "xact_commit_delta": commits,
            "xact_rollback_delta": rollbacks,
            "bench_probe_queries": probes,
            "autovacuum_runs_in_window": maintenance,
            "commits_per_action": per(db_commits, n),
            # publish_many runs one transaction per batch (the accounting pass counts it on the wire).
            "controller_commits_per_action": per(math.ceil(n / args.batch), n),
            "worker_commits_per_action": per(db_commits - math.ceil(n / args.batch), n),
            "write_txns_per_action_ledger_xmin": per(xmins["all_txns"], n),
            "worker_write_txns_per_action_ledger_xmin": per(xmins["worker_txns"], n),
            "write_txns_per_action_cluster_xids": per(xid1 - xid0, n),
            "ledger_events_per_action": per(xmins["events"], n),
            "events": {r["event"]: r["n"] for r in events},
            "lease_heartbeats": leases["heartbeats"],
            "lease_held_ms_p50": leases["held_ms_p50"],
            "stage_medians_ms": dict(stages),
            "tool_call_ms": {"p50": calls["p50"], "p99": calls["p99"]},
            "mcp": mcp,
        }

    # --- baseline -------------------------------------------------------------------------------
    def run_baseline(self, broker: str, same_calls: bool) -> dict[str, Any]:
        """One bare baseline: ``same_calls`` makes the runtime's three MCP requests per action (from
        the contract), else the first baseline's two ``ticket.create`` calls."""
        args, stack = self.args, self.stack
        n = args.actions
        client = redis.Redis.from_url(broker)
        clear_except_claim(client)
        env = {**stack.env, "BENCH_BASELINE_BROKER": broker}
        argv = [sys.executable, "-m", "celery", "-A", "ops.baseline_tasks", "worker", "-Q", baseline_tasks.QUEUE,
                "-c", str(args.concurrency), "-P", "prefork", "-l", "WARNING", "--without-gossip",
                "--without-mingle", "--without-heartbeat", "-n", f"bare-{uuid.uuid4().hex[:6]}@%h"]
        self.baseline_proc = start_process(argv, env, stack.workdir / "worker-baseline.log")
        wait_for(lambda: client.exists(f"_kombu.binding.{baseline_tasks.QUEUE}") and self.baseline_proc.poll() is None,
                 30, what="baseline worker to start")
        app = Celery("proofline-bench-baseline-client", broker=broker)
        app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True)
        run = uuid.uuid4().hex[:8]
        docs = {label: [e.model_dump(mode="json") for e in self.envelopes(count, f"bare{label}")] if same_calls else []
                for label, count in (("warm", args.warmup), ("run", n))}

        def send(i: int, label: str) -> None:
            if same_calls:
                app.send_task(baseline_tasks.SAME_CALLS_TASK, queue=baseline_tasks.QUEUE,
                              args=[i, args.action_type, docs[label][i], time.time()])
                return
            app.send_task(baseline_tasks.TASK, queue=baseline_tasks.QUEUE, args=[
                i, f"bare-{run}-{label}-{i}", {"tenant": "acme", "title": f"bare {label} {i}", "owner": "ops"},
                time.time()])

        def wait_done(count: int, timeout: float) -> None:
            wait_for(lambda: client.llen(baseline_tasks.DONE_KEY) >= count or self.baseline_proc.poll() is not None,
                     timeout, 0.01, what=f"{count} baseline tasks")
            if self.baseline_proc.poll() is not None:
                raise RuntimeError("the baseline worker exited; see worker-baseline.log")

        try:
            for i in range(args.warmup):
                send(i, "warm")
            wait_done(args.warmup, 60)
            client.delete(baseline_tasks.DONE_KEY)
            groups = CpuGroups({
                "worker": lambda: process_tree(self.baseline_proc.pid),
                "mcp_servers": lambda: [p for proc in stack.processes for p in process_tree(proc.pid)],
                "redis": lambda: [p for pid in redis_server_pids() for p in process_tree(pid)],
                "bench": lambda: [psutil.Process()],
            })
            log(f"baseline ({'same calls' if same_calls else 'two calls'}): publishing {n} bare tasks")
            mark = stack.witness.mark() if stack.witness else 0
            cpu0, busy0 = groups.sample(), machine_busy_seconds()
            t0_wall, t0 = time.time(), time.monotonic()
            for i in range(n):
                send(i, "run")
            t_pub = time.monotonic()
            wait_done(n, 60 + n * 0.2)
            cpu1, busy1, t1 = groups.sample(), machine_busy_seconds(), time.monotonic()
            mcp = mcp_requests(stack.witness, mark, n)
            log(f"baseline: {n} done in {t1 - t0:.1f}s")
        finally:
            stop_process(self.baseline_proc)
            app.close()
        done = [json.loads(x) for x in client.lrange(baseline_tasks.DONE_KEY, 0, -1)]
        client.close()
        latencies_ms = [(d[2] - d[1]) * 1000 for d in done]
        window = max(d[2] for d in done) - t0_wall
        cpu_ms = CpuGroups.delta_ms(cpu0, cpu1)
        return {
            "tasks": n,
            "ok": sum(1 for d in done if d[3]),
            "actions_per_second": per(len(done), window),
            "window_seconds": window,
            "publish_seconds": t_pub - t0,
            "latency_ms": {"p50": percentile(latencies_ms, 50), "p95": percentile(latencies_ms, 95),
                           "p99": percentile(latencies_ms, 99), "max": max(latencies_ms, default=None)},
            "cpu_ms": cpu_ms,
            "cpu_ms_per_action": {k: per(v, n) for k, v in cpu_ms.items()},
            "cpu_ms_per_action_all": per(sum(cpu_ms.values()), n),
            "foreign_load": foreign_load(busy0, busy1, sum(cpu_ms.values()), t1 - t0),
            "mcp": mcp,
        }

    # --- open loop ------------------------------------------------------------------------------
    def run_open_loop(self, rate: float) -> dict[str, Any]:
        """Publish ``--open-loop-actions`` actions one by one at ``rate`` per second (a fresh, warmed
        worker), wait until all are settled, and read publish -> final state from the ledger."""
        args, stack = self.args, self.stack
        n = args.open_loop_actions
        stack.conn = store.connect(stack.urls["controller"], application_name=CONTROLLER_APP)
        worker = start_workers(stack, count=1, concurrency=args.concurrency, name="open")[0]
        probe = self.connect_probe()
        try:
            self.warm_full(probe, worker)
            envs = self.envelopes(n, "open")
            log(f"open loop: {n} actions at {rate:.1f}/s")
            started = time.monotonic()
            late = 0.0
            for k, envelope in enumerate(envs):
                wait = started + k / rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                else:
                    late = max(late, -wait)
                self.publish_all([envelope])
            self.wait_full_path([e.action_id for e in envs], probe, timeout=60 + n * 0.5, worker=worker)
            rows = probe.execute(
                """SELECT p.action_id, extract(epoch FROM f.at - p.at)::float8 * 1000 AS ms
                   FROM ledger_events p JOIN ledger_events f ON f.action_id = p.action_id AND f.event = 'final_state'
                   WHERE p.event = 'published' AND p.action_id = ANY(%s)""", ([e.action_id for e in envs],)).fetchall()
            # Where the latency goes: the median gap before each ledger event (one action's events in
            # order), and the tool call's own duration as the worker measured it.
            gaps = probe.execute(
                """WITH e AS (SELECT event, seq, extract(epoch FROM at - lag(at) OVER (PARTITION BY action_id
                                                                                       ORDER BY seq)) * 1000 AS ms
                              FROM ledger_events WHERE action_id = ANY(%s))
                   SELECT event, min(seq) AS first_seq, count(*) AS n,
                          percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) AS p50,
                          percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) AS p99
                   FROM e WHERE ms IS NOT NULL GROUP BY event ORDER BY first_seq""",
                ([e.action_id for e in envs],)).fetchall()
            # The slowest actions' own gaps: where a tail comes from (a stage, or everything at once).
            slowest = sorted(rows, key=lambda r: r["ms"], reverse=True)[:5]
            tails = [probe.execute(
                """SELECT event, round((extract(epoch FROM at - lag(at) OVER (ORDER BY seq)) * 1000)::numeric, 1)::float8
                          AS ms FROM ledger_events WHERE action_id = %s ORDER BY seq""", (r["action_id"],)).fetchall()
                     for r in slowest]
            call = probe.execute(
                """SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY (evidence->>'elapsed_ms')::float8) AS p50
                   FROM ledger_events WHERE action_id = ANY(%s) AND event = 'tool_called'""",
                ([e.action_id for e in envs],)).fetchone()
        finally:
            probe.close()
            stop_process(worker)
        latencies = [r["ms"] for r in rows]
        return {"actions": n, "settled": len(latencies), "rate_per_second": rate,
                "publisher_most_behind_ms": late * 1000,
                "gap_before_event_ms": {r["event"]: {"n": r["n"], "p50": r["p50"], "p99": r["p99"]} for r in gaps},
                "tool_call_ms_p50": call["p50"],
                "slowest": [{"ms": r["ms"], "gap_before_event_ms": {e["event"]: e["ms"] for e in t if e["ms"] is not None}}
                            for r, t in zip(slowest, tails, strict=True)],
                "latency_ms": {"p50": percentile(latencies, 50), "p95": percentile(latencies, 95),
                               "p99": percentile(latencies, 99), "max": max(latencies, default=None)}}

    # --- accounting pass --------------------------------------------------------------------------
    def run_accounting(self) -> dict[str, Any]:
        args, stack = self.args, self.stack
        m = args.accounting_actions

        def classify(app_name: str) -> str:
            if app_name.startswith("proofline-worker"):
                return "worker"
            if app_name == CONTROLLER_APP:
                return "controller"
            return "other (heartbeat)" if not app_name else app_name

        host = urlsplit(stack.database_url)
        self.proxy = CountingProxy(host.hostname or "127.0.0.1", host.port or 5432, classify)
        port = self.proxy.start()
        proxied = with_port(stack.database_url, port)
        stack.env = {**stack.env, "PROOFLINE_DATABASE_URL": proxied}
        # The controller side publishes as proofline_controller (the workers run as the runtime role).
        stack.conn = store.connect(with_port(stack.urls["controller"], port), application_name=CONTROLLER_APP)
        worker = start_workers(stack, count=1, concurrency=args.concurrency, name="acct")[0]
        probe = self.connect_probe()
        try:
            self.warm_full(probe, worker)
            envs = self.envelopes(m, "acct")
            before = self.proxy.snapshot()
            log(f"accounting pass: {m} actions through the counting proxy")
            self.publish_all(envs)
            self.wait_full_path([e.action_id for e in envs], probe, timeout=60 + m * 0.5, worker=worker)
            after = self.proxy.snapshot()
            # One more action alone, traced statement by statement.
            traced = self.envelopes(1, "trace")
            self.proxy.start_trace()
            self.publish_all(traced)
            self.wait_full_path([traced[0].action_id], probe, timeout=30, worker=worker)
            trace = self.proxy.stop_trace()
        finally:
            probe.close()
            stop_process(worker)
        delta = per_role_delta(after, before)
        total = Counts()
        for counts in delta.values():
            total.add(counts)
        return {
            "actions": m,
            "per_role_per_action": {role: {k: v / m for k, v in c.as_dict().items()} for role, c in delta.items()},
            "total_per_action": {k: v / m for k, v in total.as_dict().items()},
            "trace_one_action": trace,
        }


# --- report ----------------------------------------------------------------------------------------


def summary(results: dict[str, Any], ratio_same: float | None) -> dict[str, Any]:
    """The headline figures, flat, for ``--json`` readers."""
    full = results.get("full") or {}
    same = results.get("baseline_same_calls") or {}
    acct = (results.get("accounting") or {}).get("per_role_per_action", {}).get("worker", {})
    return {
        "actions_per_s_full": full.get("actions_per_second"),
        "actions_per_s_bare_same_calls": same.get("actions_per_second"),
        "actions_per_s_bare_two_calls": (results.get("baseline") or {}).get("actions_per_second"),
        "ratio_same_calls": ratio_same,
        "ratio_two_calls": results.get("throughput_ratio_full_over_bare"),
        "commits_per_action": full.get("commits_per_action"),
        "worker_round_trips_per_action": acct.get("round_trips"),
        "mcp_requests_per_action": (full.get("mcp") or {}).get("per_action"),
        "mcp_requests_per_action_bare_same_calls": (same.get("mcp") or {}).get("per_action"),
        "cpu_ms_per_action_all": full.get("cpu_ms_per_action_all"),
        "cpu_ms_per_action_all_bare_same_calls": same.get("cpu_ms_per_action_all"),
        "p50_ms_half_load": ((results.get("open_loop") or {}).get("latency_ms") or {}).get("p50"),
        "p99_ms_half_load": ((results.get("open_loop") or {}).get("latency_ms") or {}).get("p99"),
        "rate_half_load": (results.get("open_loop") or {}).get("rate_per_second"),
    }


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def report(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    full, bare, acct = results.get("full"), results.get("baseline"), results.get("accounting")
    lines: list[str] = []
    ratio = None
    if full and bare and full["actions_per_second"] and bare["actions_per_second"]:
        ratio = full["actions_per_second"] / bare["actions_per_second"]
    results["throughput_ratio_full_over_bare"] = ratio
    same = results.get("baseline_same_calls")
    ratio_same = None
    if full and same and full["actions_per_second"] and same["actions_per_second"]:
        ratio_same = full["actions_per_second"] / same["actions_per_second"]
    results.update(summary(results, ratio_same))
    role = (acct or {}).get("per_role_per_action", {})
    worker_wire = role.get("worker", {})
    total_wire = (acct or {}).get("total_per_action", {})

    def row(label: str, f: Any, b: Any, digits: int = 1) -> None:
        lines.append(f"  {label:<54} {fmt(f, digits):>12} {fmt(b, digits):>12}")

    where = f"servers {args.servers}" if args.servers else f"demo server over {args.transport}"
    lines.append(f"Proofline bench: {args.actions} {args.action_type} actions, {where}, "
                 f"1 worker x {args.concurrency} prefork processes, {os.cpu_count()} CPUs, "
                 f"source {results.get('source', '?')}")
    timings = results.get("timings")
    lines.append("  runtime timings: " + (timings if isinstance(timings, str) else
                                          ", ".join(f"{k.removeprefix('PROOFLINE_').lower()}={v}"
                                                    for k, v in (timings or {}).items()) or "defaults"))
    lines.append(f"  {'':<54} {'full path':>12} {'bare Celery':>12}")
    row("actions/s (verified / finished)", full and full["actions_per_second"], bare and bare["actions_per_second"])
    row("CPU-ms per action, worker process tree", full and full["cpu_ms_per_action"]["worker"],
        bare and bare["cpu_ms_per_action"]["worker"], 2)
    row("CPU-ms per action, MCP servers", full and full["cpu_ms_per_action"]["mcp_servers"],
        bare and bare["cpu_ms_per_action"]["mcp_servers"], 2)
    row("CPU-ms per action, Postgres backends", full and full["cpu_ms_per_action"]["postgres_backends"], None, 2)
    row("CPU-ms per action, Redis server", full and full["cpu_ms_per_action"]["redis"],
        bare and bare["cpu_ms_per_action"]["redis"], 2)
    row("CPU-ms per action, bench process (publisher)", full and full["cpu_ms_per_action"]["bench"],
        bare and bare["cpu_ms_per_action"]["bench"], 2)
    row("CPU-ms per action, all of the above", full and full["cpu_ms_per_action_all"],
        bare and bare["cpu_ms_per_action_all"], 2)
    for p in ("p50", "p95", "p99"):
        row(f"{p} publish -> verified/finished (ms)", full and full["latency_ms"][p], bare and bare["latency_ms"][p])
    if full:
        row("Postgres commits/action (xact_commit delta, all clients)", full["commits_per_action"], None, 2)
        row("  of which controller 'published' txn", full["controller_commits_per_action"], None, 2)
        row("  of which worker (+ reconciler sweeps, new connections)", full["worker_commits_per_action"], None, 2)
        row("write txns/action (distinct xmin of ledger events)", full["write_txns_per_action_ledger_xmin"], None, 2)
        row("  of which worker", full["worker_write_txns_per_action_ledger_xmin"], None, 2)
        row("write txns/action (xid growth, cluster-wide)", full["write_txns_per_action_cluster_xids"], None, 2)
        row("ledger events/action", full["ledger_events_per_action"], None, 2)
    if acct:
        row(f"round trips/action, all clients (wire, {acct['actions']}-action pass)", total_wire.get("round_trips"),
            None, 2)
        row("  of which worker", worker_wire.get("round_trips"), None, 2)
        row("statements/action, all clients (wire)", total_wire.get("statements"), None, 2)
        row("  of which worker", worker_wire.get("statements"), None, 2)
        row("transactions/action on the wire (all / worker)", total_wire.get("transactions"), None, 2)
        lines[-1] += f"   worker {fmt(worker_wire.get('transactions'), 2)}"
        row("write transactions/action on the wire (all / worker)", total_wire.get("write_transactions"), None, 2)
        lines[-1] += f"   worker {fmt(worker_wire.get('write_transactions'), 2)}"
    else:
        lines.append("  round trips/action: not measured (pg_stat_statements is not loaded; accounting pass disabled)")
    lines.append(f"  {'throughput ratio full / bare (two calls)':<54} {fmt(ratio, 2):>12}")
    if same:
        lines.append(f"  {'bare Celery, the same MCP requests as the runtime:':<54}")
        lines.append(f"  {'  actions/s':<54} {fmt(same['actions_per_second']):>12}")
        lines.append(f"  {'  CPU-ms per action, all':<54} {fmt(same['cpu_ms_per_action_all'], 2):>12}")
        lines.append(f"  {'  MCP requests per action (witness)':<54} {fmt(same['mcp']['per_action'], 2):>12}")
        lines.append(f"  {'throughput ratio full / bare (same calls)':<54} {fmt(ratio_same, 2):>12}")
    if full:
        lines.append(f"  {'MCP requests per action, full path (witness)':<54} {fmt(full['mcp']['per_action'], 2):>12}"
                     f"   tools/list {fmt(full['mcp']['tools_list_per_action'], 2)}; by method {full['mcp']['by_method']}")
    open_loop = results.get("open_loop")
    if open_loop:
        lat = open_loop["latency_ms"]
        lines.append(f"  open loop at {open_loop['rate_per_second']:.1f}/s ({open_loop['settled']}/{open_loop['actions']} "
                     f"settled): publish -> final p50 {fmt(lat['p50'])} ms, p95 {fmt(lat['p95'])} ms, "
                     f"p99 {fmt(lat['p99'])} ms (publisher at most {fmt(open_loop['publisher_most_behind_ms'])} ms late)")
        gaps = open_loop.get("gap_before_event_ms") or {}
        lines.append("    median gap before each event (ms): " + ", ".join(
            f"{event} {fmt(g['p50'])}" for event, g in gaps.items()) + f"; tool call itself {fmt(open_loop.get('tool_call_ms_p50'))}")
        for slow in open_loop.get("slowest") or []:
            lines.append(f"    a slowest action, {fmt(slow['ms'])} ms, gaps: " + ", ".join(
                f"{event} {fmt(ms)}" for event, ms in slow["gap_before_event_ms"].items()))
    if full:
        unexpected = {k: v for k, v in full["events"].items() if k not in HAPPY_EVENTS}
        if unexpected:
            lines.append(f"  note: events off the happy path in the window: {unexpected}")
        lines.append(f"  window: full {fmt(full['window_seconds'], 2)}s (publishing {fmt(full['publish_seconds'], 2)}s), "
                     f"bare {fmt(bare and bare['window_seconds'], 2)}s; bench completion checks in the window: "
                     f"{full['bench_probe_queries']} (removed from commits); autovacuum/analyze runs in the "
                     f"window: {full['autovacuum_runs_in_window']} (left in)")

    if full and bare:
        lines.append(f"  CPU used by other processes on this machine during the windows: full path "
                     f"{full['foreign_load']['other_share_of_machine']:.0%}, bare "
                     f"{bare['foreign_load']['other_share_of_machine']:.0%} of all cores (noise: rerun if high)")
    if full:
        st = full["stage_medians_ms"]
        lines.append(f"  full-path stage medians (ms): queue->validated {fmt(st['queue_to_execute_ms'])}, "
                     f"validated->tool_called {fmt(st['execute_to_tool_called_ms'])}, tool_called->final_state "
                     f"{fmt(st['tool_called_to_verified_ms'])}; tool call p50 {fmt(full['tool_call_ms']['p50'])} "
                     f"p99 {fmt(full['tool_call_ms']['p99'])}; lease heartbeats {full['lease_heartbeats']}")
    lines.append("Targets (informational):")
    checks = []
    if full:
        commits = full["commits_per_action"]
        checks.append(("at most 3 commits per verified action, publish included (xact_commit delta / N)", commits,
                       commits is not None and commits <= TARGET_COMMITS))
        calls = ((full.get("mcp") or {}).get("by_method") or {}).get("tools/call")
        per_call = calls / full["actions"] if calls is not None else None
        checks.append((f"{TARGET_MCP_CALLS} MCP tool calls per action (precondition read, write, verification read)",
                       per_call, per_call == TARGET_MCP_CALLS))
    if ratio_same is not None:
        checks.append(("same-calls throughput ratio (full / bare making the same MCP requests)", ratio_same,
                       ratio_same >= TARGET_RATIO_SAME_CALLS))
    round_trips = results.get("worker_round_trips_per_action")
    if round_trips is not None:
        checks.append(("worker round trips to Postgres per action", round_trips, round_trips <= TARGET_ROUND_TRIPS))
    p99 = results.get("p99_ms_half_load")
    if p99 is not None:
        checks.append(("p99 publish -> verified at half saturation (ms)", p99, p99 <= TARGET_P99_MS))
    for label, value, ok in checks:
        lines.append(f"  {'PASS' if ok else 'MISS'}  {label}: {fmt(value, 2)}")
    if full:
        worker_commits = full["worker_commits_per_action"]
        worker_writes = full["worker_write_txns_per_action_ledger_xmin"]
        lines.append(f"        other readings of 'commits': worker only (no publish) {fmt(worker_commits, 2)} "
                     f"{'PASS' if worker_commits <= TARGET_COMMITS else 'MISS'}; write txns incl. publish "
                     f"{fmt(full['write_txns_per_action_ledger_xmin'], 2)}; worker write txns {fmt(worker_writes, 2)} "
                     f"{'PASS' if worker_writes <= TARGET_COMMITS else 'MISS'}")
    results["targets"] = [{"target": label, "value": value, "pass": ok} for label, value, ok in checks]
    return lines


HAPPY_EVENTS = {"published", "validated", "revalidated", "lease_acquired", "idempotency_claimed",
                "preconditions_passed", "tool_called", "verification_enqueued", "verification_finished",
                "final_state"}  # verification_enqueued only when the execute task's own read did not decide


def print_trace(trace: list[dict[str, Any]]) -> None:
    print("Statements of one action on the wire (E = extended-protocol execute, Q = simple query, "
          "Z = transaction end):")
    for t in trace:
        extra = " (wrote)" if t.get("wrote") else ""
        print(f"  {t['role']:<18} #{t['conn']:<6} {t['kind']}  {t['sql'][:110]}{extra}")


# --- main --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ops.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--actions", type=int, default=300, help="actions (and bare tasks) in each timed window")
    parser.add_argument("--transport", choices=("http", "stdio"), default="http")
    parser.add_argument("--warmup", type=int, default=10, help="warm-up actions, excluded from the figures")
    parser.add_argument("--concurrency", type=int, default=Settings().worker_concurrency,
                        help="prefork processes per worker, full path and baselines alike (default: the worker's, "
                             "PROOFLINE_WORKER_CONCURRENCY, twice the processors)")
    parser.add_argument("--accounting-actions", type=int, default=50,
                        help="actions counted on the wire through the proxy after the timed window (0: skip)")
    parser.add_argument("--targets", type=int, default=0,
                        help="spread actions over this many ticket queues (0: one queue per action, no lock contention)")
    parser.add_argument("--redis-db", type=int, default=None,
                        help="Redis database of the full path (default: the first free one, claimed)")
    parser.add_argument("--baseline-redis-db", type=int, default=None, help="Redis database of the baseline")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON to this path")
    parser.add_argument("--trace", action="store_true", help="print the statements of one action on the wire")
    parser.add_argument("--test-timings", action="store_true",
                        help="keep the test stack's short lease and reconciler timings instead of the runtime defaults")
    parser.add_argument("--stall-seconds", type=float, default=30.0,
                        help="give up when the broker's pending messages stay unchanged this long")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs) after a successful run")
    parser.add_argument("--servers", type=Path, default=None,
                        help="a servers file of your own (stdio servers are put behind the witness relay to count "
                             "MCP requests); default: the demo system of record")
    parser.add_argument("--contracts", type=Path, default=None, help="the contracts folder for --action-type")
    parser.add_argument("--action-type", default="ticket.create")
    parser.add_argument("--arguments", type=json.loads, default=DEFAULT_ARGUMENTS,
                        help="JSON template of the action's arguments; {n} (unique in the run), {i} (index in its batch), "
                             "{run}, {label}, {queue} are filled in")
    parser.add_argument("--target", type=json.loads, default=DEFAULT_TARGET, help="JSON template of the target")
    parser.add_argument("--tenant", default="acme")
    parser.add_argument("--batch", type=int, default=50, help="envelopes per publish_many call (one transaction)")
    parser.add_argument("--open-loop-actions", type=int, default=500,
                        help="actions of the open-loop run at half the saturation throughput (0: skip it); its p99 "
                             "is the fifth slowest of 500, where of 200 it was the second, which one stall decides")
    parser.add_argument("--worker-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the stack's workers (for example PROOFLINE_TOOL_LIST_MAX_AGE_SECONDS=0); "
                             "repeatable")
    parser.add_argument("--rate", type=float, default=None,
                        help="open-loop rate (actions/s) instead of half the measured saturation")
    args = parser.parse_args(argv)
    if args.actions < 1 or args.warmup < 1 or args.batch < 1:
        parser.error("--actions, --warmup and --batch must be at least 1")
    if any("=" not in item for item in args.worker_env):
        parser.error("--worker-env takes NAME=VALUE")
    return args


def use_servers_file(stack: Stack, servers: Path) -> Path:
    """Point the stack at ``servers`` instead of the demo's, with every stdio identity behind the
    witness relay. The copy sits next to the original (relative paths in it stay valid) and is
    removed at the end; HTTP servers are not relayed, so their requests are not counted."""
    wrapped = servers.resolve().parent / f".proofline-bench-{uuid.uuid4().hex[:8]}.yaml"
    assert stack.witness is not None
    wrapped.write_text(witness_stdio_servers(servers.read_text(), stack.witness.path))
    stack.env["PROOFLINE_SERVERS_FILE"] = str(wrapped)
    stack.servers_file = wrapped
    stack.settings = stack.settings.model_copy(update={"servers_file": wrapped})
    return wrapped


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    workdir = Path(tempfile.mkdtemp(prefix="proofline-bench-"))
    # Both Redis databases are claimed (proofline_kit.resources): another bench or test run on this
    # machine never shares one, which would mix their tasks and completion lists.
    bare_claim = claim_redis_db(redis_url(), range(args.baseline_redis_db, args.baseline_redis_db + 1)
                                if args.baseline_redis_db is not None else range(15, 0, -1))
    bare_db = bare_claim.number
    full_db = args.redis_db
    stack: Stack | None = None
    bench: Bench | None = None
    wrapped: Path | None = None
    failed = True
    try:
        bench_source = source_state()
        log(f"building the stack ({args.transport}, baseline Redis db {bare_db}, {workdir})")
        timings = {} if args.test_timings else runtime_defaults()
        # Fault points off, as in production (the test stack arms them per test).
        extra = {**timings, "PROOFLINE_FAULT_POINTS_ENABLED": "false",
                 **({"PROOFLINE_CONTRACTS_DIR": str(args.contracts.resolve())} if args.contracts else {}),
                 **dict(item.split("=", 1) for item in args.worker_env)}
        stack = build_stack(args.transport, workdir, redis_db=full_db, extra_env=extra)
        assert stack.redis_claim is not None
        full_db = stack.redis_claim.number
        if args.servers is not None:
            wrapped = use_servers_file(stack, args.servers)
        admin = psycopg.connect(ADMIN_URL, autocommit=True, row_factory=dict_row)
        bench = Bench(args, stack, admin, stack.admin_url.rsplit("/", 1)[1])
        bench.results["source"] = bench_source
        bench.results["timings"] = "test stack (--test-timings)" if args.test_timings else timings
        bench.live()
        worker = start_workers(stack, count=1, concurrency=args.concurrency)[0]
        probe = bench.connect_probe()
        log(f"warming up the full path ({args.warmup} actions)")
        bench.warm_full(probe, worker)
        quiet_since = time.monotonic()
        if args.servers is None:
            bench.results["baseline"] = bench.run_baseline(f"{redis_url()}/{bare_db}", same_calls=False)
        bench.results["baseline_same_calls"] = bench.run_baseline(f"{redis_url()}/{bare_db}", same_calls=True)
        bench.results["full"] = bench.run_full(worker, probe, quiet_since)
        if args.open_loop_actions > 0:
            saturation = bench.results["full"]["actions_per_second"]
            bench.results["open_loop"] = bench.run_open_loop(args.rate or saturation / 2)
        if args.accounting_actions > 0:
            bench.results["accounting"] = bench.run_accounting()
        lines = report(bench.results, args)
        print("\n".join(lines))
        if args.trace and "accounting" in bench.results:
            print_trace(bench.results["accounting"]["trace_one_action"])
        bench.results["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        bench.results["config"].update({"cpus": os.cpu_count(), "redis_db": full_db, "baseline_redis_db": bare_db})
        if args.json:
            args.json.write_text(json.dumps(bench.results, indent=2, default=str))
            log(f"wrote {args.json}")
        full = bench.results["full"]
        bad = full["actions"] - full["verified"]
        bare_bad = sum(b["tasks"] - b["ok"] for b in (bench.results.get("baseline"), bench.results["baseline_same_calls"])
                       if b)
        if bad or bare_bad:
            log(f"ERROR: {bad} actions did not end closed/completed_verified; {bare_bad} bare tasks failed")
            return 1
        failed = False
        return 0
    finally:
        if wrapped is not None:
            wrapped.unlink(missing_ok=True)
        if bench is not None:
            if bench.baseline_proc is not None:
                stop_process(bench.baseline_proc)
            if bench.proxy is not None:
                bench.proxy.stop()
            bench.admin.close()
        if stack is not None:
            try:
                teardown_stack(stack)
            except Exception as exc:  # noqa: BLE001 - report, keep cleaning up
                log(f"teardown failed: {exc!r}")
        try:
            release_redis_db(bare_claim)  # the stack's own claim is released by teardown_stack
        except redis.RedisError:
            pass
        if failed:
            for worker_log in sorted(workdir.glob("worker-*.log")):
                tail = worker_log.read_text(errors="replace").splitlines()[-8:]
                log(f"last lines of {worker_log.name}:\n    " + "\n    ".join(line[:240] for line in tail))
        if failed or args.keep:
            log(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
