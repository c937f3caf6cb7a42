"""Inputs of the capacity model (``ops/CAPACITY.md``): per verified action, by component, what each
part of a deployment spends, and what this machine's Postgres can take.

    .venv/bin/python -m ops.capacity [--actions 200] [--transport http] [--pgbench-seconds 8]
                                     [--skip-pgbench] [--json PATH]

Re-runnable on any commit: it drives the product only through its public pieces (the kit's stack
builder, ``proofline worker``, the controller's ``publish``), so a change that removes commits or
round trips shows up as smaller figures here, with no change to this script.

**Per component.** The components run one after another on one stack, so whatever happens in the
ledger database during a phase belongs to that phase's component:

1. ``publish``: N ``ticket.create`` envelopes published by this process (no worker running);
2. ``execute``: a node consuming only the execute queues runs them (verification messages wait);
3. ``verify``: a node consuming only the verify queues verifies them;
4. ``reconciler``: a node consuming only ``reconcile``, with its own beat, sweeps an idle ledger
   holding the N settled actions; figures are per sweep run (``sweep_runs``).

Each node is started on an idle queue, its CPU sampled once it is up, and only then told to
consume its queues (Celery remote control), so start-up cost is not charged to the actions.

For each phase:

- **CPU-ms**: user+system CPU (psutil) of the node's process tree; the MCP servers' processes (the
  system of record's writer and reader; the witness relays in front of them are test instruments,
  shown apart); the Postgres backends serving the ledger database (``pg_stat_activity``); this
  process for ``publish``. Redis and Postgres' background writers are shared by every session on
  this machine and are not attributed.
- **commits**: ``pg_stat_database.xact_commit`` of the ledger database, read after the node's
  connections closed (a backend flushes its counters on exit).
- **WAL bytes**: ``pg_walinspect`` over the phase's LSN range (a temporary replication slot keeps
  the segments): records whose block references name the ledger database, plus the commit records
  of their transactions; full-page images (after a checkpoint, frequent on this shared server)
  are shown apart. The cluster-wide LSN advance
  is printed next to it: other databases on this shared server write there too.
- **round trips, statements, transactions**: counted on the wire by ``ops.pgwire`` (every worker
  connection and the publisher's go through it).
- the 1-minute load average, read at the end of the phase (the machine is shared).

**Postgres ceiling** (``pgbench``, a scratch database created and dropped here): the built-in
TPC-B-like script and a transaction shaped like Proofline's per-action writes
(``PROOFLINE_SHAPED``: two ledger-event inserts with a hash and a JSON document, and one guarded
status update), each for ``--pgbench-seconds`` at 1, 2, 4 and 8 clients.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import psycopg
from psycopg.rows import dict_row

from ledger import store
from ops.bench import cpu_delta, cpu_seconds, process_tree, source_state
from ops.pgwire import CountingProxy, Counts, per_role_delta
from proofline.controller import publish
from proofline.settings import Settings
from proofline.shards import sharded_queues
from proofline_kit.processes import start_process, stop_process, wait_for
from proofline_kit.resources import ADMIN_URL, with_database
from proofline_kit.stack import STACK_ENV, Stack, build_stack, teardown_stack

IDLE_QUEUE = "capacity-idle"
SWEEP_INTERVAL = 1.0
CLIENTS = (1, 2, 4, 8)

PROOFLINE_SHAPED_SETUP = """
DROP TABLE IF EXISTS pl_events, pl_actions;
CREATE TABLE pl_actions (action_id bigint PRIMARY KEY, status text NOT NULL, version int NOT NULL,
                         updated_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE pl_events (id bigserial PRIMARY KEY, action_id bigint NOT NULL, seq int NOT NULL, event text NOT NULL,
                        evidence jsonb NOT NULL, hash text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp(),
                        UNIQUE (action_id, seq));
INSERT INTO pl_actions SELECT g, 'executing', 0 FROM generate_series(1, 100000) g;
VACUUM ANALYZE pl_actions;
"""

#: One write transaction of the kind Proofline runs two or three of per action: events appended to
#: the action's chain (a hash over the previous one) and the action's status moved, guarded.
PROOFLINE_SHAPED = r"""
\set aid random(1, 100000)
\set seq random(1, 1000000000)
BEGIN;
INSERT INTO pl_events (action_id, seq, event, evidence, hash) VALUES (:aid, :seq, 'tool_called',
  '{"tool": "create_ticket", "server": "sor", "elapsed_ms": 41.2, "result": {"ticket_id": "t-123456", "status": "open"}, "fencing_token": 1234}',
  encode(sha256((:aid || ':' || :seq || ':tool_called')::bytea), 'hex'));
INSERT INTO pl_events (action_id, seq, event, evidence, hash) VALUES (:aid, :seq + 1, 'state',
  '{"from": "executing", "to": "verifying", "reason_code": null}',
  encode(sha256((:aid || ':' || :seq || ':state')::bytea), 'hex'));
UPDATE pl_actions SET status = 'verifying', version = version + 1, updated_at = clock_timestamp()
  WHERE action_id = :aid AND status IN ('executing', 'verifying');
COMMIT;
"""


def log(message: str) -> None:
    print(f"[capacity {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def load1() -> float:
    return os.getloadavg()[0]


def cpu_ms(procs: list[psutil.Process]) -> dict[int, float]:
    return {pid: seconds * 1000 for pid, seconds in cpu_seconds(procs).items()}


def via_proxy(url: str, port: int) -> str:
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    return f"{parts.scheme}://{user}127.0.0.1:{port}{parts.path}?sslmode=disable&gssencmode=disable"


class Probe:
    """A scratch database (``pg_walinspect`` installed; ``pgbench`` runs here too) and reads of the
    ledger database's counters from outside it (reading adds nothing to the ledger's counters)."""

    def __init__(self, stack: Stack) -> None:
        self.name = f"pl_capacity_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.name}"')
        self.url = with_database(ADMIN_URL, self.name)
        self.conn = psycopg.connect(self.url, autocommit=True, row_factory=dict_row)
        self.conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        # Other sessions' CREATE DATABASE checkpoints would recycle the segments a phase must read:
        # a temporary slot (gone with this session, whatever happens) keeps them until we are done.
        self.conn.execute("SELECT pg_create_physical_replication_slot(%s, true, true)", (self.name,))
        self.ledger = urlsplit(stack.admin_url).path.lstrip("/")
        self.oid = self.conn.execute("SELECT oid FROM pg_database WHERE datname = %s", (self.ledger,)).fetchone()["oid"]

    def close(self) -> None:
        self.conn.close()
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')

    def lsn(self) -> str:
        """The WAL insert position, once it is flushed (pg_walinspect reads only flushed WAL; the
        WAL writer flushes within ``wal_writer_delay``)."""
        lsn = self.conn.execute("SELECT pg_current_wal_insert_lsn()::text AS lsn").fetchone()["lsn"]
        wait_for(lambda: self.conn.execute("SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn AS ok",
                                           (lsn,)).fetchone()["ok"], 10, what="the WAL to be flushed")
        return lsn

    def commits(self) -> int:
        self.conn.execute("SELECT pg_stat_clear_snapshot()")
        return int(self.conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                                     (self.ledger,)).fetchone()["xact_commit"])

    def backends(self) -> list[int]:
        return [r["pid"] for r in self.conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()", (self.ledger,))]

    def wal(self, start: str, end: str) -> dict[str, int]:
        """WAL bytes between two LSNs: the ledger database's records and their commits, and all."""
        if start == end:
            # A phase that wrote nothing (verify, when every action was verified in place by the
            # execute phase): pg_get_wal_records_info refuses a start at the current end of WAL.
            return {"data_bytes": 0, "fpi_bytes": 0, "commit_bytes": 0, "write_xacts": 0, "cluster_bytes": 0}
        row = self.conn.execute(
            """WITH r AS (SELECT * FROM pg_get_wal_records_info(%(s)s::pg_lsn, %(e)s::pg_lsn)),
                    ours AS (SELECT * FROM r WHERE block_ref LIKE %(pattern)s),
                    xids AS (SELECT DISTINCT xid FROM ours WHERE xid <> 0)
               SELECT (SELECT coalesce(sum(record_length), 0) FROM ours) AS data_bytes,
                      (SELECT coalesce(sum(fpi_length), 0) FROM ours) AS fpi_bytes,
                      (SELECT coalesce(sum(record_length), 0) FROM r WHERE resource_manager = 'Transaction'
                          AND xid IN (SELECT xid FROM xids)) AS commit_bytes,
                      (SELECT count(*) FROM xids) AS write_xacts,
                      (%(e)s::pg_lsn - %(s)s::pg_lsn)::bigint AS cluster_bytes""",
            {"s": start, "e": end, "pattern": f"%/{self.oid}/%"}).fetchone()
        return {k: int(v) for k, v in row.items()}

    def wait_backends_gone(self, keep: set[int], timeout: float = 20.0) -> None:
        wait_for(lambda: set(self.backends()) <= keep, timeout, what="the node's connections to close")
        time.sleep(0.5)  # the exiting backends' statistics reach the shared counters


class Poller:
    """The completion checks, on a connection of their own (its backend's CPU is left out, its
    transactions are counted and subtracted), at most twice a second."""

    def __init__(self, url: str) -> None:
        self.conn = store.connect(url, application_name="proofline-capacity-poll")
        self.pid = self.conn.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"]
        self.polls = 0

    def one(self, sql: str, params: tuple) -> dict[str, Any]:
        self.polls += 1
        row = self.conn.execute(sql, params).fetchone()
        assert row is not None
        return row

    def until(self, predicate: Any, timeout: float, what: str) -> None:
        wait_for(predicate, timeout, interval=0.5, what=what)


class Phase:
    """Snapshots around one component's work."""

    def __init__(self, probe: Probe, proxy: CountingProxy, procs: list[psutil.Process], poller: Poller) -> None:
        self.probe, self.proxy, self.procs, self.poller = probe, proxy, procs, poller
        self.lsn0, self.commits0, self.wire0 = probe.lsn(), probe.commits(), proxy.snapshot()
        self.polls0 = poller.polls
        self.cpu0 = cpu_ms(procs)
        self.pg0 = cpu_ms(self.backends())

    def backends(self) -> list[psutil.Process]:
        """The ledger database's backends, except the one that polls for completion."""
        return [psutil.Process(p) for p in self.probe.backends() if p != self.poller.pid and psutil.pid_exists(p)]

    def end_cpu(self, procs: list[psutil.Process]) -> None:
        """Read CPU before the node stops (its processes and its backends still exist)."""
        self.cpu1 = cpu_ms(procs)
        self.pg1 = cpu_ms(self.backends())

    def finish(self, n: int, groups: dict[str, list[int]]) -> dict[str, Any]:
        lsn1 = self.probe.lsn()
        wal = self.probe.wal(self.lsn0, lsn1)
        # Each completion check is one autocommit read in the ledger database: not the component's.
        commits = self.probe.commits() - self.commits0 - (self.poller.polls - self.polls0)
        wire = per_role_delta(self.proxy.snapshot(), self.wire0)
        total = Counts()
        for counts in wire.values():
            total.add(counts)
        cpu = {name: sum(self.cpu1.get(p, 0.0) - self.cpu0.get(p, 0.0) for p in pids if p in self.cpu1)
               for name, pids in groups.items()}
        cpu["postgres_backends"] = cpu_delta(self.pg0, self.pg1)
        return {
            "n": n, "load1": load1(),
            "cpu_ms_per_unit": {k: v / n for k, v in cpu.items()},
            "commits_per_unit": commits / n,
            "wal_bytes_per_unit": (wal["data_bytes"] + wal["commit_bytes"]) / n,
            "wal_fpi_bytes_per_unit": wal["fpi_bytes"] / n,
            "write_xacts_per_unit": wal["write_xacts"] / n,
            "cluster_wal_bytes": wal["cluster_bytes"],
            "round_trips_per_unit": total.round_trips / n,
            "statements_per_unit": total.statements / n,
            "transactions_per_unit": total.transactions / n,
        }


class Capacity:
    def __init__(self, args: argparse.Namespace, stack: Stack, probe: Probe, proxy: CountingProxy) -> None:
        self.args, self.stack, self.probe, self.proxy = args, stack, probe, proxy
        self.poller = Poller(stack.admin_url)
        self.server_pids = [p.pid for proc in stack.processes for p in process_tree(proc.pid)]

    def servers(self) -> dict[str, list[int]]:
        mcp, witness = [], []
        for pid in self.server_pids:
            try:
                cmd = " ".join(psutil.Process(pid).cmdline())
            except psutil.NoSuchProcess:
                continue
            (witness if "witness" in cmd else mcp).append(pid)
        return {"mcp_servers": mcp, "witness_relays": witness}

    def start_node(self, name: str, beat: bool = False) -> subprocess.Popen:
        env = {**self.stack.env, "PROOFLINE_DATABASE_URL": via_proxy(self.stack.database_url, self.proxy.port)}
        if beat:
            # A sweep's cost does not depend on the interval; a short one just measures it sooner.
            env["PROOFLINE_RECONCILE_INTERVAL_SECONDS"] = str(SWEEP_INTERVAL)
        argv = [sys.executable, "-m", "proofline", "worker", "--queues", IDLE_QUEUE, "--concurrency",
                str(self.args.concurrency), "--without-gossip", "--without-mingle", "-n", f"{name}@%h"]
        if beat:
            argv += ["-B", "-s", str(self.stack.workdir / f"beat-{name}.db")]
        log_file = self.stack.workdir / f"capacity-{name}.log"
        proc = start_process(argv, env, log_file)
        wait_for(lambda: " ready." in log_file.read_text(errors="replace") or proc.poll() is not None, 90,
                 what=f"node {name} to start")
        if proc.poll() is not None:
            raise RuntimeError(f"node {name} exited while starting; see {log_file}")
        time.sleep(1.0)  # pool processes finish importing
        return proc

    def consume(self, name: str, queues: list[str]) -> None:
        destination = [f"{name}@{os.uname().nodename}"]
        for queue in queues:
            replies = self.stack.app.control.add_consumer(queue, destination=destination, reply=True, timeout=10)
            if not replies:
                raise RuntimeError(f"node {name} did not answer add_consumer({queue})")

    def statuses(self, ids: list[str]) -> dict[str, int]:
        row = self.poller.one("SELECT coalesce(jsonb_object_agg(status, n), '{}') AS s FROM (SELECT status::text, "
                              "count(*) AS n FROM actions WHERE action_id = ANY(%s) GROUP BY 1) c", (ids,))
        return {k: int(v) for k, v in row["s"].items()}

    def run_node_phase(self, name: str, queues: list[str], ids: list[str], done: Any, beat: bool = False,
                       units: Any = None) -> dict[str, Any]:
        node = self.start_node(name, beat=beat)
        keep = set(self.probe.backends())
        node_procs = process_tree(node.pid)
        servers = self.servers()
        procs = node_procs + [psutil.Process(p) for pids in servers.values() for p in pids if psutil.pid_exists(p)]
        phase = Phase(self.probe, self.proxy, procs, self.poller)
        self.consume(name, queues)
        self.poller.until(done, 60 + len(ids), what=f"{name} to finish its work")
        node_procs = process_tree(node.pid)  # pool processes replaced meanwhile are in here too
        phase.end_cpu(node_procs + procs)
        n = units() if units is not None else len(ids)
        stop_process(node)
        self.probe.wait_backends_gone(keep)
        return phase.finish(n, {"node": [p.pid for p in node_procs], **servers})

    def run(self) -> dict[str, Any]:
        s, n = self.stack, self.args.actions
        shards = s.settings.tenant_shards
        run = uuid.uuid4().hex[:8]
        # A target per action, as independent work has: no action waits for another's target lock.
        envs = [s.envelope("ticket.create", arguments={"tenant": "acme", "title": f"cap-{i}", "owner": "ops"},
                           target={"type": "ticket_queue", "id": f"acme-cap-{run}-{i}"}) for i in range(n)]
        ids = [e.action_id for e in envs]
        results: dict[str, Any] = {}

        log(f"publish: {n} actions")
        me = psutil.Process()
        keep = set(self.probe.backends())
        phase = Phase(self.probe, self.proxy, [me], self.poller)
        with store.connect(via_proxy(s.urls["controller"], self.proxy.port)) as conn:
            for env in envs:
                publish(s.settings, conn, s.app, env)
            phase.end_cpu([me])
        self.probe.wait_backends_gone(keep)
        results["publish"] = phase.finish(n, {"publisher": [me.pid]})

        log("execute: a node consuming the execute queues")
        results["execute"] = self.run_node_phase(
            "capacity-execute", [*sharded_queues("actions", shards), "compensate"], ids,
            lambda: not {"published", "executing"} & set(self.statuses(ids)))
        log("verify: a node consuming the verify queues")
        results["verify"] = self.run_node_phase(
            "capacity-verify", sharded_queues("verify", shards), ids,
            lambda: set(self.statuses(ids)) <= {"closed", "escalated"})
        results["outcomes"] = self.statuses(ids)
        with s.conn.cursor() as cur:
            # Storage per action (the database holds only these actions): what a retention or
            # partitioning plan is sized by.
            cur.execute("SELECT relname, pg_total_relation_size(c.oid) AS bytes FROM pg_class c "
                        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.relkind = 'r' "
                        "AND relname IN ('ledger_events', 'actions', 'idempotency_records', 'leases', "
                        "'message_deliveries')")
            results["storage_bytes_per_action"] = {r["relname"]: r["bytes"] / n for r in cur.fetchall()}

        log(f"reconciler: {self.args.sweeps} sweeps over the settled ledger")
        first = self.poller.one("SELECT coalesce(max(run_id), 0) AS m FROM sweep_runs", ())["m"]

        def swept() -> int:
            return int(self.poller.one("SELECT count(*) AS n FROM sweep_runs WHERE run_id > %s "
                                       "AND finished_at IS NOT NULL", (first,))["n"])

        results["reconciler_per_sweep"] = self.run_node_phase(
            "capacity-reconcile", ["reconcile"], ids, lambda: swept() >= self.args.sweeps, beat=True, units=swept)
        results["reconcile_interval_seconds"] = s.settings.reconcile_interval_seconds
        return results


def production_timings() -> dict[str, str]:
    """The runtime's defaults for every timing the test stack shortens."""
    fields = Settings.model_fields
    return {name: str(fields[name[len("PROOFLINE_"):].lower()].default) for name in STACK_ENV
            if name.startswith("PROOFLINE_") and name[len("PROOFLINE_"):].lower() in fields}


def pgbench(url: str, seconds: int) -> dict[str, Any]:
    """The Postgres ceiling on this machine: TPC-B-like and a Proofline-shaped write transaction."""
    parts = urlsplit(url)
    base = ["-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 5432), "-U", parts.username or "postgres"]
    db = parts.path.lstrip("/")
    env = {**os.environ, "PGPASSWORD": parts.password or ""}
    subprocess.run(["pgbench", *base, "-i", "-s", "10", "-q", db], check=True, env=env, capture_output=True)
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in PROOFLINE_SHAPED_SETUP.strip().split(";\n"):
            if statement.strip():
                conn.execute(statement)
    out: dict[str, Any] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
        script.write(PROOFLINE_SHAPED)
    try:
        for name, extra in (("tpcb_like", ["-b", "tpcb-like"]), ("proofline_shaped", ["-f", script.name])):
            out[name] = []
            for clients in CLIENTS:
                with psycopg.connect(url, autocommit=True) as conn:
                    lsn0 = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
                cpu0 = psutil.cpu_times()
                run = subprocess.run(["pgbench", *base, *extra, "-c", str(clients), "-j", str(min(clients, 2)),
                                      "-T", str(seconds), "-n", db], env=env, capture_output=True, text=True,
                                     check=True)
                cpu1 = psutil.cpu_times()
                with psycopg.connect(url, autocommit=True) as conn:
                    wal = conn.execute("SELECT pg_current_wal_insert_lsn() - %s::pg_lsn", (str(lsn0),)).fetchone()[0]
                tps = next(float(line.split("=")[1].split()[0]) for line in run.stdout.splitlines()
                           if line.startswith("tps"))
                busy = sum((cpu1.user - cpu0.user, cpu1.system - cpu0.system, cpu1.iowait - cpu0.iowait))
                out[name].append({"clients": clients, "tps": tps, "load1": load1(),
                                  "cluster_wal_bytes_per_s": float(wal) / seconds,
                                  "machine_cpu_busy_fraction": busy / (seconds * psutil.cpu_count())})
                log(f"pgbench {name} c={clients}: {tps:.0f} tps (load {load1():.2f})")
    finally:
        os.unlink(script.name)
    return out


def model(r: dict[str, Any]) -> dict[str, Any]:
    """The per-action totals, and how many worker boxes like this one a Postgres like this one carries."""
    comps = ("publish", "execute", "verify")
    per_action = {key: sum(r[c][key] for c in comps) for key in
                  ("commits_per_unit", "wal_bytes_per_unit", "round_trips_per_unit", "write_xacts_per_unit")}
    worker_cpu = r["execute"]["cpu_ms_per_unit"]["node"] + r["verify"]["cpu_ms_per_unit"]["node"]
    pg_cpu = sum(r[c]["cpu_ms_per_unit"]["postgres_backends"] for c in comps)
    mcp_cpu = r["execute"]["cpu_ms_per_unit"]["mcp_servers"] + r["verify"]["cpu_ms_per_unit"]["mcp_servers"]
    cores = psutil.cpu_count() or 2
    out: dict[str, Any] = {"per_action": {**per_action, "worker_cpu_ms": worker_cpu, "postgres_cpu_ms": pg_cpu,
                                          "mcp_server_cpu_ms": mcp_cpu,
                                          "publisher_cpu_ms": r["publish"]["cpu_ms_per_unit"]["publisher"]}}
    # A worker box of this machine's size, kept at 70% CPU, with its MCP servers elsewhere.
    out["actions_per_s_per_worker_box"] = 0.7 * cores * 1000 / worker_cpu
    out["postgres_cpu_bound_actions_per_s"] = 0.7 * cores * 1000 / pg_cpu
    # The reconciler sweeps once per interval for the whole fleet (recovery/sweep_gate.py): its cost
    # per action falls as the fleet's rate rises. Shown at the Postgres ceiling's rate below.
    sweep = r["reconciler_per_sweep"]
    out["reconciler_per_second"] = {"commits": sweep["commits_per_unit"] / r["reconcile_interval_seconds"],
                                    "wal_bytes": sweep["wal_bytes_per_unit"] / r["reconcile_interval_seconds"],
                                    "cpu_ms": sweep["cpu_ms_per_unit"]["node"] / r["reconcile_interval_seconds"]}
    if "pgbench" in r:
        best = max(x["tps"] for x in r["pgbench"]["proofline_shaped"])
        out["postgres_commit_bound_actions_per_s"] = best / per_action["write_xacts_per_unit"]
        out["postgres_ceiling_actions_per_s"] = min(out["postgres_commit_bound_actions_per_s"],
                                                    out["postgres_cpu_bound_actions_per_s"])
        out["worker_boxes_per_postgres"] = out["postgres_ceiling_actions_per_s"] / out["actions_per_s_per_worker_box"]
    return out


def report(r: dict[str, Any]) -> list[str]:
    lines = [f"Proofline capacity inputs: {r['actions']} ticket.create actions, transport {r['transport']}, "
             f"source {r['source']}, {psutil.cpu_count()} CPUs"]
    row = "{:<22}{:>10}{:>10}{:>10}{:>12}{:>10}{:>10}{:>10}{:>8}"
    lines.append(row.format("component", "node CPU", "MCP CPU", "PG CPU", "WAL bytes", "commits", "write tx",
                            "rtrips", "load1"))
    for name in ("publish", "execute", "verify", "reconciler_per_sweep"):
        c = r[name]
        cpu = c["cpu_ms_per_unit"]
        lines.append(row.format(name, f"{cpu.get('node', cpu.get('publisher', 0)):.2f}",
                                f"{cpu.get('mcp_servers', 0):.2f}", f"{cpu['postgres_backends']:.2f}",
                                f"{c['wal_bytes_per_unit']:.0f}", f"{c['commits_per_unit']:.2f}",
                                f"{c['write_xacts_per_unit']:.2f}", f"{c['round_trips_per_unit']:.1f}",
                                f"{c['load1']:.2f}"))
    lines.append("(per action; the reconciler's row is per sweep run; CPU in ms, witness relays not included)")
    lines.append(f"outcomes: {r['outcomes']}")
    lines.append("storage bytes per action: " + json.dumps({k: round(v) for k, v in
                                                            r.get("storage_bytes_per_action", {}).items()}))
    for name, runs in r.get("pgbench", {}).items():
        lines.append(f"pgbench {name}: " + ", ".join(f"c={x['clients']} {x['tps']:.0f} tps (load {x['load1']:.1f})"
                                                     for x in runs))
    lines.append("model: " + json.dumps({k: (round(v, 2) if isinstance(v, float) else v)
                                         for k, v in r["model"].items() if k != "per_action"}))
    lines.append("per action: " + json.dumps({k: round(v, 2) for k, v in r["model"]["per_action"].items()}))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actions", type=int, default=200)
    parser.add_argument("--transport", choices=("http", "stdio"), default="http")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork processes per node")
    parser.add_argument("--sweeps", type=int, default=10, help="reconciler sweep runs to measure")
    parser.add_argument("--pgbench-seconds", type=int, default=8)
    parser.add_argument("--skip-pgbench", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs) after the run")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="proofline-capacity-"))
    log(f"building the stack ({args.transport}, {workdir}); load {load1():.2f}")
    # The runtime's own timings, not the test stack's short ones (leases, heartbeats, re-drives).
    stack = build_stack(args.transport, workdir, extra_env=production_timings())
    proxy = CountingProxy("127.0.0.1", urlsplit(stack.database_url).port or 5432)
    proxy.start()
    probe = Probe(stack)
    try:
        results: dict[str, Any] = {"actions": args.actions, "transport": args.transport, "source": source_state(),
                                   "load1_start": load1()}
        results.update(Capacity(args, stack, probe, proxy).run())
        if not args.skip_pgbench:
            results["pgbench"] = pgbench(probe.url, args.pgbench_seconds)
        results["model"] = model(results)
    finally:
        proxy.stop()
        teardown_stack(stack)
        probe.close()
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)  # the nodes' logs; kept when a run fails
    print("\n".join(report(results)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
