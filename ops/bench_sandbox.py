"""What the stdio sandbox and its audit cost: spawn + initialize, and per call, against a baseline.

    .venv/bin/python -m ops.bench_sandbox [--spawns 9] [--calls 300] [--json PATH]

Both sides run the repo's system-of-record server (``python -m proofline_kit.sor``, writer role) from
the repo's own ``servers.yaml`` entry, on the same seeded SQLite file, in the same run:

- **audited**: the entry as it stands (bubblewrap, namespaces, rlimits; worker/sandbox.py; and the
  denied-path audit under strace, worker/sandbox_audit.py, reading its FIFO as a worker does);
- **sandboxed**: the same entry with ``sandbox: {audit: false}`` (sandbox, no audit);
- **baseline**: the same entry with ``sandbox: {enabled: false}`` (the pre-sandbox launch).

Figures
-------
- spawn + initialize: time for ``mcp.Client`` to start the server and finish the protocol
  handshake (``async with`` entry), ``--spawns`` times each, alternating sides; median.
- per call: one session per side kept open (as workers keep them), warmed up, then ``--calls``
  read-only ``find_ticket_by_key`` calls per side, in alternating blocks of 25; median and mean.
Ratios are sandboxed / baseline, audited / sandboxed and audited / baseline, measured in the same
run on the same machine. The audited side must also find no violation (a well-behaved server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from mcp import Client

from proofline.settings import ROOT
from proofline_kit.sor import store as sor
from worker.connect import endpoint_target
from worker.sandbox_reader import Auditor
from worker.servers import Endpoint, load_servers

#: Calls per side per block; blocks alternate sides so load drift hits both alike.
BLOCK = 25
SIDES = ("baseline", "sandboxed", "audited")


def endpoints(workdir: Path) -> dict[str, Endpoint]:
    spec = yaml.safe_load((ROOT / "servers.yaml").read_text())["servers"]["sor"]
    bare = {**spec, "sandbox": {"enabled": False, "reason": "benchmark baseline"}}
    quiet = {**spec, "sandbox": {**spec["sandbox"], "audit": False, "audit_reason": "benchmark"}}
    path = workdir / "servers.yaml"
    path.write_text(yaml.safe_dump({"servers": {"audited": spec, "sandboxed": quiet, "baseline": bare}}))
    servers = load_servers(path)
    return {side: servers[side].write for side in SIDES}


def target(side: str, endpoint: Endpoint, workdir: Path, auditors: list[Auditor]) -> Any:
    if side != "audited":
        return endpoint_target(endpoint, workdir)
    auditor = Auditor("sor", "write")
    auditors.append(auditor)
    return endpoint_target(endpoint, workdir, audit=auditor)


async def spawn_once(side: str, endpoint: Endpoint, workdir: Path, auditors: list[Auditor]) -> float:
    started = time.perf_counter()
    async with Client(target(side, endpoint, workdir, auditors), mode=endpoint.protocol) as client:
        elapsed = time.perf_counter() - started
        assert client.server_info is not None
        if side == "audited":
            auditors[-1].settle()
            assert auditors[-1].armed, "the audit did not start"
    return elapsed


async def call_block(client: Client, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        result = await client.call_tool("find_ticket_by_key", {"idempotency_key": "bench-absent"})
        times.append(time.perf_counter() - t)
        assert not result.is_error, result.content
    return times


async def measure(workdir: Path, spawns: int, calls: int) -> dict[str, Any]:
    eps = endpoints(workdir)
    order = list(SIDES)
    auditors: list[Auditor] = []
    spawn: dict[str, list[float]] = {k: [] for k in order}
    try:
        for side in order:
            await spawn_once(side, eps[side], workdir, auditors)  # warm the page cache for every side
        for i in range(spawns):
            for side in order if i % 2 == 0 else reversed(order):
                spawn[side].append(await spawn_once(side, eps[side], workdir, auditors))
        per_call: dict[str, list[float]] = {k: [] for k in order}
        async with Client(target("baseline", eps["baseline"], workdir, auditors)) as base, \
                Client(target("sandboxed", eps["sandboxed"], workdir, auditors)) as boxed, \
                Client(target("audited", eps["audited"], workdir, auditors)) as audited:
            clients = {"baseline": base, "sandboxed": boxed, "audited": audited}
            for c in clients.values():
                await call_block(c, 30)  # warm-up, not counted
            done = 0
            while done < calls:
                n = min(BLOCK, calls - done)
                for side in order if (done // BLOCK) % 2 == 0 else reversed(order):
                    per_call[side] += await call_block(clients[side], n)
                done += n
        for a in auditors:
            a.take()
        violations = sum(a.total for a in auditors)
    finally:
        for a in auditors:
            a.close()
    return {"spawn": spawn, "per_call": per_call, "violations": violations}


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side in SIDES:
        s, c = raw["spawn"][side], raw["per_call"][side]
        out[side] = {"spawn_init_median_ms": statistics.median(s) * 1000,
                     "call_median_ms": statistics.median(c) * 1000, "call_mean_ms": statistics.fmean(c) * 1000,
                     "spawns": len(s), "calls": len(c)}
    out["ratios"], out["added_ms"] = {}, {}
    for name, top, bottom in (("sandboxed/baseline", "sandboxed", "baseline"),
                              ("audited/sandboxed", "audited", "sandboxed"), ("audited/baseline", "audited", "baseline")):
        x, b = out[top], out[bottom]
        out["ratios"][name] = {"spawn_init": x["spawn_init_median_ms"] / b["spawn_init_median_ms"],
                               "call_median": x["call_median_ms"] / b["call_median_ms"],
                               "call_mean": x["call_mean_ms"] / b["call_mean_ms"]}
        out["added_ms"][name] = {"spawn_init": x["spawn_init_median_ms"] - b["spawn_init_median_ms"],
                                 "call_median": x["call_median_ms"] - b["call_median_ms"]}
    out["audit_violations"] = raw["violations"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spawns", type=int, default=9)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if shutil.which("bwrap") is None or shutil.which("strace") is None:
        parser.error("bubblewrap (bwrap) and strace are needed")
    # The baseline is unsandboxed on purpose: its per-spawn warning is not news here.
    logging.getLogger("worker.stdio_launch").setLevel(logging.ERROR)
    workdir = Path(tempfile.mkdtemp(prefix="bench-sandbox-"))
    try:
        db = workdir / "var" / "sor.sqlite3"
        sor.init_db(db)
        sor.seed_demo(db)
        os.environ["SOR_DB"] = str(db)
        os.environ.setdefault("PYTHONPATH", str(ROOT))
        summary = summarise(asyncio.run(measure(workdir, args.spawns, args.calls)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    pairs = list(summary["ratios"])
    print(f"{'':24}" + "".join(f"{side:>12}" for side in SIDES) + "".join(f"{p:>20}" for p in pairs))
    for label, key, unit in (("spawn+initialize (med)", "spawn_init_median_ms", "spawn_init"),
                             ("per call (median)", "call_median_ms", "call_median"),
                             ("per call (mean)", "call_mean_ms", "call_mean")):
        print(f"{label:24}" + "".join(f"{summary[side][key]:>10.2f}ms" for side in SIDES)
              + "".join(f"{summary['ratios'][p][unit]:>20.2f}" for p in pairs))
    print(f"spawns per side: {summary['baseline']['spawns']}, calls per side: {summary['baseline']['calls']}, "
          f"violations found by the audit: {summary['audit_violations']}, "
          f"load average after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
