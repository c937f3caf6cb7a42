"""What the stdio sandbox costs: spawn + initialize, and per call, against an unsandboxed baseline.

    .venv/bin/python -m ops.bench_sandbox [--spawns 9] [--calls 300] [--json PATH]

Both sides run the repo's system-of-record server (``python -m proofline_kit.sor``, writer role) from
the repo's own ``servers.yaml`` entry, on the same seeded SQLite file, in the same run:

- **sandboxed**: the entry as it stands (bubblewrap, namespaces, rlimits; worker/sandbox.py);
- **baseline**: the same entry with ``sandbox: {enabled: false}`` (the pre-sandbox launch).

Figures
-------
- spawn + initialize: time for ``mcp.Client`` to start the server and finish the protocol
  handshake (``async with`` entry), ``--spawns`` times each, alternating sides; median.
- per call: one session per side kept open (as workers keep them), warmed up, then ``--calls``
  read-only ``find_ticket_by_key`` calls per side, in alternating blocks of 25; median and mean.
Ratios are sandboxed / baseline, measured in the same run on the same machine.
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
from worker.mcp_client import endpoint_target
from worker.servers import Endpoint, load_servers

#: Calls per side per block; blocks alternate sides so load drift hits both alike.
BLOCK = 25


def endpoints(workdir: Path) -> dict[str, Endpoint]:
    spec = yaml.safe_load((ROOT / "servers.yaml").read_text())["servers"]["sor"]
    bare = {**spec, "sandbox": {"enabled": False, "reason": "benchmark baseline"}}
    path = workdir / "servers.yaml"
    path.write_text(yaml.safe_dump({"servers": {"sandboxed": spec, "baseline": bare}}))
    servers = load_servers(path)
    return {"sandboxed": servers["sandboxed"].write, "baseline": servers["baseline"].write}


async def spawn_once(endpoint: Endpoint, workdir: Path) -> float:
    started = time.perf_counter()
    async with Client(endpoint_target(endpoint, workdir), mode=endpoint.protocol) as client:
        elapsed = time.perf_counter() - started
        assert client.server_info is not None
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
    order = ["baseline", "sandboxed"]
    spawn: dict[str, list[float]] = {k: [] for k in order}
    await spawn_once(eps["baseline"], workdir)  # warm the page cache for both sides
    await spawn_once(eps["sandboxed"], workdir)
    for i in range(spawns):
        for side in order if i % 2 == 0 else reversed(order):
            spawn[side].append(await spawn_once(eps[side], workdir))
    per_call: dict[str, list[float]] = {k: [] for k in order}
    async with Client(endpoint_target(eps["baseline"], workdir)) as base, \
            Client(endpoint_target(eps["sandboxed"], workdir)) as boxed:
        clients = {"baseline": base, "sandboxed": boxed}
        for c in clients.values():
            await call_block(c, 30)  # warm-up, not counted
        done = 0
        while done < calls:
            n = min(BLOCK, calls - done)
            for side in order if (done // BLOCK) % 2 == 0 else reversed(order):
                per_call[side] += await call_block(clients[side], n)
            done += n
    return {"spawn": spawn, "per_call": per_call}


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side in ("baseline", "sandboxed"):
        s, c = raw["spawn"][side], raw["per_call"][side]
        out[side] = {"spawn_init_median_ms": statistics.median(s) * 1000,
                     "call_median_ms": statistics.median(c) * 1000, "call_mean_ms": statistics.fmean(c) * 1000,
                     "spawns": len(s), "calls": len(c)}
    b, x = out["baseline"], out["sandboxed"]
    out["ratios"] = {
        "spawn_init": x["spawn_init_median_ms"] / b["spawn_init_median_ms"],
        "call_median": x["call_median_ms"] / b["call_median_ms"],
        "call_mean": x["call_mean_ms"] / b["call_mean_ms"],
    }
    out["added_ms"] = {"spawn_init": x["spawn_init_median_ms"] - b["spawn_init_median_ms"],
                       "call_median": x["call_median_ms"] - b["call_median_ms"]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spawns", type=int, default=9)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if shutil.which("bwrap") is None:
        parser.error("bubblewrap (bwrap) is not installed")
    # The baseline is unsandboxed on purpose: its per-spawn warning is not news here.
    logging.getLogger("worker.mcp_client").setLevel(logging.ERROR)
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
    b, x, r = summary["baseline"], summary["sandboxed"], summary["ratios"]
    print(f"{'':24}{'baseline':>12}{'sandboxed':>12}{'ratio':>8}")
    print(f"{'spawn+initialize (med)':24}{b['spawn_init_median_ms']:>10.1f}ms{x['spawn_init_median_ms']:>10.1f}ms"
          f"{r['spawn_init']:>8.2f}")
    print(f"{'per call (median)':24}{b['call_median_ms']:>10.2f}ms{x['call_median_ms']:>10.2f}ms"
          f"{r['call_median']:>8.2f}")
    print(f"{'per call (mean)':24}{b['call_mean_ms']:>10.2f}ms{x['call_mean_ms']:>10.2f}ms{r['call_mean']:>8.2f}")
    print(f"spawns per side: {b['spawns']}, calls per side: {b['calls']}, "
          f"load average after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
