"""Throughput with telemetry on versus off, in one run.

    .venv/bin/python -m ops.telemetry_bench [--actions N] [--rounds R] [--transport http] [--json PATH]

One stack (``tests.conftest.build_stack``), then ``--rounds`` pairs of timed windows, "off" then
"on", then "on" then "off" (ABBA), so that drift of a shared machine falls on both. Each window starts a fresh
supervised worker (two prefork processes), warms it up, publishes N ``ticket.create`` envelopes (each on
a target of its own, so none waits for another's lease) and
waits until each is settled; throughput is N over the ledger's own window (first ``published`` to
last ``final_state``, database clock).

- off: no metrics endpoint, no ``OTEL_*`` (tracing's null context), text logs.
- sampled (``--sampled``): as on, with one action in ten traced (the standard ratio sampler).
- metrics, spans, logs (``--parts``): one part on alone (the endpoint and multiprocess counters;
  tracing to span files; JSON logs), to break the cost down.
- on: ``proofline worker --metrics-port`` (prometheus_client multiprocess mode, scraped every
  5 s by this process during the window; Prometheus's default is 15 s), tracing with every span
  written by the ``jsonl`` exporter (batched, as the OTLP exporter is), JSON logs. The controller
  side (this process) is not traced in either window.

The figure is on/off throughput (target: at least 0.90, i.e. at most 10% lower). Also reported:
the worker's CPU per action (its supervisor, Celery main and pool processes), which a busy
shared machine disturbs less than throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from ops.bench import cpu_delta, cpu_seconds, log, process_tree, runtime_defaults, source_state
from tests.conftest import (
    SETTLED,
    Stack,
    build_stack,
    free_port,
    start_workers,
    stop_process,
    teardown_stack,
    wait_for,
)

#: The parts telemetry is made of, each of which a window can turn on alone.
PARTS = frozenset({"metrics", "spans", "logs"})
#: The share of actions traced in the "sampled" windows (``--sampled``): OpenTelemetry's standard
#: ``parentbased_traceidratio`` sampler; the others' spans are non-recording and never exported.
SAMPLED = 0.1


def settled(stack: Stack, ids: list[str]) -> bool:
    with stack.conn.cursor() as cur:
        cur.execute("SELECT count(*) AS n FROM actions WHERE action_id = ANY(%s) AND status = ANY(%s)",
                    (ids, [s.value for s in SETTLED]))
        return cur.fetchone()["n"] == len(ids)


def window(stack: Stack, ids: list[str]) -> tuple[float, int, int]:
    with stack.conn.cursor() as cur:
        cur.execute("""SELECT extract(epoch FROM max(at) FILTER (WHERE event = 'final_state')
                                          - min(at) FILTER (WHERE event = 'published')) AS seconds,
                              count(*) FILTER (WHERE event = 'final_state'
                                               AND evidence->>'outcome' = 'completed_verified') AS verified,
                              count(*) FILTER (WHERE event = 'target_busy') AS busy
                       FROM ledger_events WHERE action_id = ANY(%s)""", (ids,))
        row = cur.fetchone()
    return float(row["seconds"]), int(row["verified"]), int(row["busy"])


def ticket(stack: Stack) -> Any:
    """A ``ticket.create`` on a target of its own: actions sharing one target wait for each other's
    lease and are delivered again, and how often depends on timing, so each retry would be CPU
    that telemetry's speed moved rather than CPU telemetry spent (``target_busy`` counts any)."""
    name = uuid.uuid4().hex[:12]
    return stack.envelope("ticket.create", arguments={"tenant": "acme", "title": f"t-{name}", "owner": "ops"},
                          target={"type": "ticket_queue", "id": f"acme-ops-{name}"})


def by_role(root: int, procs: list[Any], before: dict[int, float], after: dict[int, float], n: int) -> dict[str, float]:
    """CPU-ms per action of the supervisor, Celery's main process and the pool processes."""
    parents = {}
    for proc in procs:
        try:
            parents[proc.pid] = proc.ppid()
        except Exception:  # noqa: BLE001 - a process that ended has no role left to report
            continue
    roles: dict[str, float] = {"supervisor": 0.0, "celery_main": 0.0, "pool": 0.0}
    for pid, value in after.items():
        role = "supervisor" if pid == root else "celery_main" if parents.get(pid) == root else "pool"
        roles[role] += (value - before.get(pid, 0.0)) * 1000 / n
    return {k: round(v, 1) for k, v in roles.items()}


def run_window(stack: Stack, mode: str, n: int, warmup: int, index: int) -> dict[str, Any]:
    env = dict(stack.env)
    port = None
    parts = PARTS if mode in ("on", "sampled") else {mode} & PARTS
    if "metrics" in parts:
        port = free_port()
        env.update(PROOFLINE_METRICS_PORT=str(port), PROMETHEUS_MULTIPROC_DIR=str(stack.workdir / f"metrics-{index}"))
    if "spans" in parts:
        env.update(OTEL_TRACES_EXPORTER="jsonl", PROOFLINE_TRACES_DIR=str(stack.workdir / f"traces-{index}"))
    if "logs" in parts:
        env.update(PROOFLINE_LOG_FORMAT="json")
    if mode == "sampled":
        env.update(OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG=str(SAMPLED))
    worker = start_workers(stack, name=f"{mode}{index}-", beat=False, env=env)[0]
    scraping = threading.Event()
    scrapes = [0]

    def scrape() -> None:
        while not scraping.wait(5.0):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:  # noqa: S310 - loopback
                r.read()
            scrapes[0] += 1

    try:
        warm = [ticket(stack) for _ in range(warmup)]
        for env_ in warm:
            stack.publish(env_)
        wait_for(lambda: settled(stack, [e.action_id for e in warm]), 120, what="the warm-up")
        scraper = threading.Thread(target=scrape, daemon=True) if port else None
        if scraper:
            scraper.start()
        batch = [ticket(stack) for _ in range(n)]
        tree = process_tree(worker.pid)
        cpu0 = cpu_seconds(tree)
        for env_ in batch:
            stack.publish(env_)
        ids = [e.action_id for e in batch]
        wait_for(lambda: settled(stack, ids), 600, interval=0.5, what=f"{n} actions ({mode})")
        after = process_tree(worker.pid)
        cpu1 = cpu_seconds(after)
        cpu_ms = cpu_delta(cpu0, cpu1) * 1000 / n
        roles = by_role(worker.pid, after, cpu0, cpu1, n)
        scraping.set()
        if scraper:
            scraper.join(5)
        seconds, verified, busy = window(stack, ids)
    finally:
        stop_process(worker)
        stack.workers.remove(worker)
    spans = sum(1 for p in (stack.workdir / f"traces-{index}").glob("*.jsonl") for _ in p.open())
    result = {"mode": mode, "actions": n, "verified": verified, "seconds": round(seconds, 3),
              "actions_per_s": round(n / seconds, 2), "worker_cpu_ms_per_action": round(cpu_ms, 1), "cpu_ms_by_process": roles, "spans": spans,
              "scrapes": scrapes[0],
              "target_busy": busy}
    log(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.telemetry_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--actions", type=int, default=150, help="actions per timed window")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of windows (off, on and with --parts each part), order reversed every other round")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--transport", choices=("http", "stdio"), default="http")
    parser.add_argument("--parts", action="store_true", help="also a window per part (metrics, spans, logs) each round")
    parser.add_argument("--sampled", action="store_true", help=f"also a window with everything on and "
                        f"{SAMPLED:.0%}% of actions traced (OTEL_TRACES_SAMPLER=parentbased_traceidratio)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    modes = ["off", "on", *(["sampled"] if args.sampled else []), *(sorted(PARTS) if args.parts else [])]
    stack = build_stack(args.transport, Path(tempfile.mkdtemp(prefix="proofline-telemetry-bench-")),
                        extra_env=runtime_defaults())
    try:
        stack.live()
        results = []
        for round_ in range(args.rounds):
            # off-on, then on-off (ABBA): a machine getting busier or quieter favours neither.
            for mode in modes if round_ % 2 == 0 else modes[::-1]:
                results.append(run_window(stack, mode, args.actions, args.warmup, len(results)))
    finally:
        teardown_stack(stack)
    rate = {m: sum(r["actions"] for r in results if r["mode"] == m) / sum(r["seconds"] for r in results
                                                                            if r["mode"] == m) for m in modes}
    cpu = {m: statistics.mean(r["worker_cpu_ms_per_action"] for r in results if r["mode"] == m) for m in modes}
    by_round = [{r["mode"]: r for r in results[i:i + len(modes)]} for i in range(0, len(results), len(modes))]
    pairs = [p["on"]["actions_per_s"] / p["off"]["actions_per_s"] for p in by_round]
    summary = {"off_actions_per_s": round(rate["off"], 2), "on_actions_per_s": round(rate["on"], 2),
               "on_over_off": round(rate["on"] / rate["off"], 3), "pair_ratios": [round(p, 3) for p in pairs],
               "median_pair_ratio": round(statistics.median(pairs), 3),
               "worker_cpu_ms_per_action": {m: round(v, 1) for m, v in cpu.items()},
               "cpu_on_over_off": round(cpu["on"] / cpu["off"], 3),
               # What each part adds alone: its windows' CPU per action minus the off windows'.
               "cpu_ms_added_by_part": {m: round(cpu[m] - cpu["off"], 1) for m in modes if m in PARTS},
               "cpu_over_off": {m: round(cpu[m] / cpu["off"], 3) for m in modes if m != "off"},
               "throughput_over_off": {m: round(rate[m] / rate["off"], 3) for m in modes if m != "off"},
               "source": source_state(), "windows": results,
               "config": {"transport": args.transport, "actions": args.actions, "rounds": args.rounds, "modes": modes}}
    print(json.dumps({k: v for k, v in summary.items() if k != "windows"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    bad = [r for r in results if r["verified"] != r["actions"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
