"""Throughput while pool processes die, with and without the node's session host, in one run.

    .venv/bin/python -m ops.availability_bench [--actions 400] [--intervals 0,2,0.5] [--hosts on,off]

The servers are the demo system of record over stdio, sandboxed by bubblewrap and audited under
strace as production runs them: a writer and a reader identity, so every pool process uses two
server processes. Two execute workers of two prefork processes each (no beat, so nothing else of
theirs is killed) and one recovery worker with beat share a Redis broker; timings are the runtime's
own defaults, not the test stack's short ones.

For each session-host setting (``on``: worker/session_host.py lends servers to the pool processes;
``off``: each pool process starts its own), one stack is built and warmed up, then, ``--rounds``
times, for each kill interval in turn ``--actions`` tickets (each on its own queue, so no two contend for a target) are published
at once and drained while a killer sends SIGKILL to one pool process, chosen at random among both
workers', every interval seconds (0: no kills, the baseline). Throughput is actions / (last final
state - first publication), both from the ledger. The ratio to the same setting's run without kills
in the same round is the figure, and its median over the rounds is printed; the targets are 0.8
at one kill every 2 s and 0.5 at one every 0.5 s. Run it on a machine nothing else is loading: a
killed process loses the action it was running, so the cost of a kill grows with the length of an
action, and a busy machine lengthens every action.

Also reported per window: kills sent, actions re-driven by the reconciler (``redriven`` events:
messages re-sent although Celery had requeued the killed process's message), deliveries suppressed
as duplicates, and a check that every action ended with exactly one effect.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from ops.bench import runtime_defaults
from proofline.settings import Settings
from proofline_kit.processes import wait_for
from proofline_kit.stack import Stack, build_stack, start_workers, teardown_stack
from worker.dispatch import CeleryDispatch

TARGETS = {2.0: 0.8, 0.5: 0.5}


def log(message: str) -> None:
    print(f"[availability] {message}", file=sys.stderr, flush=True)


def pool_processes(workers: list[Any]) -> list[psutil.Process]:
    """The prefork processes of the execute workers (not their Celery main process, not the host)."""
    found = []
    for supervisor in workers:
        try:
            for main in psutil.Process(supervisor.pid).children():
                for child in main.children():
                    if child.status() != psutil.STATUS_ZOMBIE and "worker.session_host" not in " ".join(child.cmdline()):
                        found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


class Killer(threading.Thread):
    def __init__(self, workers: list[Any], interval: float, seed: int) -> None:
        super().__init__(daemon=True)
        self.workers, self.interval = workers, interval
        self.random = random.Random(seed)
        self.stop = threading.Event()
        self.kills = 0

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            pools = pool_processes(self.workers)
            if not pools:
                continue
            victim = self.random.choice(pools)
            try:
                os.kill(victim.pid, signal.SIGKILL)
                self.kills += 1
            except ProcessLookupError:
                pass


def tickets(stack: Stack, count: int, label: str) -> list[Any]:
    run = uuid.uuid4().hex[:8]
    return [stack.envelope("ticket.create", arguments={"tenant": "acme", "title": f"{label} {i}", "owner": "ops"},
                           target={"type": "ticket_queue", "id": f"acme-{label}-{run}-{i}"}) for i in range(count)]


def publish(stack: Stack, envelopes: list[Any]) -> None:
    from proofline.controller import publish_many

    dispatch = CeleryDispatch(stack.app, stack.settings.tenant_shards)
    for at in range(0, len(envelopes), 50):
        publish_many(stack.settings, stack.conn, dispatch, envelopes[at:at + 50])


def settled(stack: Stack, ids: list[str]) -> int:
    """Actions the runtime is done with: closed, or escalated to an operator (an action whose
    recovery retries were used up by kills ends so; its outcome is reported with the rest)."""
    with stack.conn.cursor() as cur:
        cur.execute("SELECT count(*) AS n FROM actions WHERE action_id = ANY(%s) AND status IN ('closed', 'escalated')",
                    (ids,))
        return cur.fetchone()["n"]


def window(stack: Stack, workers: list[Any], count: int, interval: float, label: str, timeout: float,
           seed: int) -> dict[str, Any]:
    envelopes = tickets(stack, count, label)
    ids = [e.action_id for e in envelopes]
    killer = Killer(workers, interval, seed) if interval > 0 else None
    publish(stack, envelopes)
    if killer is not None:
        killer.start()
    started = time.monotonic()
    timed_out = False
    try:
        wait_for(lambda: settled(stack, ids) == count, timeout, interval=0.5,
                 what=f"{count} actions to settle ({label})")
    except AssertionError:
        timed_out = True  # reported with what settled by then, the kills stopped
    finally:
        if killer is not None:
            killer.stop.set()
            killer.join()
    if timed_out:
        done = settled(stack, ids)
        log(f"{label}: {done} of {count} settled in {timeout:g} s; waiting for the rest without kills")
        wait_for(lambda: settled(stack, ids) == count, 900, interval=0.5, what=f"{label} to settle after the kills")
        return {"interval_s": interval, "actions": count, "seconds": round(time.monotonic() - started, 2),
                "actions_per_s": round(done / timeout, 2), "kills": killer.kills if killer else 0,
                "timed_out": True, "settled_in_window": done, "redriven": 0, "duplicates_suppressed": 0,
                "outcomes": {}, "keys_with_two_effects": sum(1 for e in envelopes if stack.effects(e.idempotency_key) > 1)}
    with stack.conn.cursor() as cur:
        cur.execute("""
            SELECT extract(epoch FROM max(at) FILTER (WHERE event = 'final_state') - min(at) FILTER (WHERE event = 'published')) AS span,
                   count(*) FILTER (WHERE event = 'redriven') AS redriven,
                   count(*) FILTER (WHERE event = 'duplicate_suppressed') AS suppressed
            FROM ledger_events WHERE action_id = ANY(%s)""", (ids,))
        row = cur.fetchone()
        cur.execute("SELECT CASE WHEN status = 'escalated' THEN 'escalated:' || outcome ELSE outcome::text END AS outcome, "
                    "count(*) AS n FROM actions WHERE action_id = ANY(%s) GROUP BY 1", (ids,))
        outcomes = {r["outcome"]: r["n"] for r in cur.fetchall()}
    duplicates = sum(1 for e in envelopes if stack.effects(e.idempotency_key) > 1)
    span = float(row["span"])
    return {"interval_s": interval, "actions": count, "seconds": round(span, 2), "actions_per_s": round(count / span, 2),
            "kills": killer.kills if killer else 0, "redriven": row["redriven"], "duplicates_suppressed": row["suppressed"],
            "outcomes": outcomes, "keys_with_two_effects": duplicates}


def run_setting(host: str, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    env = {**runtime_defaults(), "PROOFLINE_STDIO_SESSION_HOST": "true" if host == "on" else "false",
           "PROOFLINE_STDIO_SESSION_SPARES": str(args.spares)}
    stack = build_stack("stdio", tmp / f"host-{host}", extra_env=env)
    try:
        start_workers(stack, count=1, concurrency=1, name="rec", role="recovery", beat=True)
        workers = start_workers(stack, count=args.workers, concurrency=args.concurrency, name="ex",
                                role="execute", beat=False)
        window(stack, workers, args.warmup, 0, "warm", args.timeout, args.seed)
        out = []
        # Rounds of every interval in turn: a change in the machine's other load between windows
        # shows in one round's ratios, not in all of them (the median is reported).
        for round_ in range(args.rounds):
            for interval in args.intervals:
                result = window(stack, workers, args.actions, interval, f"r{round_}k{interval}", args.timeout,
                                args.seed + round_)
                result.update(session_host=host, round=round_, load_average=os.getloadavg()[0])
                log(json.dumps(result))
                out.append(result)
                wait_for(lambda: len(pool_processes(workers)) >= args.workers * args.concurrency, 60,
                         what="Celery to replace the killed pool processes")
        return out
    finally:
        teardown_stack(stack)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.availability_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--actions", type=int, default=400, help="actions per window")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of windows, every interval once in each")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--intervals", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 2.0, 0.5])
    parser.add_argument("--hosts", type=lambda s: s.split(","), default=["on", "off"])
    parser.add_argument("--timeout", type=float, default=900.0, help="longest wait for one window to settle")
    parser.add_argument("--spares", type=int, default=Settings().stdio_session_spares,
                        help="idle servers per identity the session host keeps (the runtime's default)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if 0.0 not in args.intervals:
        args.intervals = [0.0, *args.intervals]
    import tempfile

    tmp = args.workdir or Path(tempfile.mkdtemp(prefix="availability-"))
    results = {host: run_setting(host, args, tmp) for host in args.hosts}
    load = os.getloadavg()
    print(f"{'host':<5} {'kill every':>10} {'actions/s':>10} {'ratio':>6} {'target':>6} {'kills':>6} "
          f"{'redriven':>8} {'suppressed':>10} {'dup keys':>8}   (medians over {args.rounds} rounds; "
          "each ratio is against its own round's window without kills)")
    summary: dict[str, Any] = {"load_average": load, "results": results, "ratios": {}}
    ok = True
    for host, rows in results.items():
        base = {r["round"]: r["actions_per_s"] for r in rows if r["interval_s"] == 0}
        for interval in args.intervals:
            mine = [r for r in rows if r["interval_s"] == interval]
            ratio = statistics.median(r["actions_per_s"] / base[r["round"]] for r in mine)
            target = TARGETS.get(interval)
            if host == "on" and target is not None and ratio < target:
                ok = False
            dups = sum(r["keys_with_two_effects"] for r in mine)
            ok = ok and dups == 0
            summary["ratios"][f"{host}@{interval:g}"] = round(ratio, 3)
            every = "never" if interval == 0 else f"{interval:g} s"
            print(f"{host:<5} {every:>10} {statistics.median(r['actions_per_s'] for r in mine):>10.2f} {ratio:>6.2f} "
                  f"{(f'{target:.2f}' if target else '-'):>6} {sum(r['kills'] for r in mine):>6} "
                  f"{sum(r['redriven'] for r in mine):>8} {sum(r['duplicates_suppressed'] for r in mine):>10} {dups:>8}")
    print(f"load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
