"""Tenant fairness: one tenant's single-action latency alone and behind another tenant's burst, in one run.

    .venv/bin/python -m ops.fairness_bench [--burst 500] [--probes 3] [--shards 8] [--same-shard]
                                           [--fair-share 1] [--json PATH]

On one stack (``tests.conftest.build_stack``, HTTP system of record, one worker with two prefork
processes), in order:

1. warm-up: a few actions of a third tenant (excluded);
2. **unloaded**: ``--probes`` single ``ticket.create`` actions of tenant ``quiet``, one after the other
   on an idle stack;
3. **loaded**: ``--burst`` actions of tenant ``noisy`` are published (all queued before the first
   probe), then ``--probes`` actions of ``quiet``, one after the other, while the burst is still
   being worked off;
4. the mean task time: the burst's wall time (first ``published`` to last ``final_state``) times the
   worker's process slots, divided by the burst size: how long one action occupies one slot.

Latency is ``final_state.at - published.at`` from the ledger (database clock). The target is
"loaded latency within twice the unloaded latency plus one task time". ``--shards 1`` puts every
tenant on the one ``actions`` queue (the behaviour before tenant shards), for comparison.
``--same-shard`` names the probing tenant so that it hashes to the burst's shard (the two share one
FIFO queue); ``--fair-share 0`` turns fair turns within a shard off (worker/fairness.py), the
behaviour before them. Each loaded probe also reports how much of the burst was still unsettled
when it was published and when it settled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

SLOTS = 2  # one worker, two prefork processes


def ticket(stack: Any, tenant: str) -> Any:
    queue = f"{tenant}-q-{uuid.uuid4().hex[:8]}"
    return stack.envelope("ticket.create", tenant=tenant, arguments={"tenant": tenant, "title": f"t-{queue}",
                                                                     "owner": "ops"},
                          target={"type": "ticket_queue", "id": queue})


def event_at(stack: Any, action_ids: list[str], event: str, agg: str) -> Any:
    with stack.conn.cursor() as cur:
        cur.execute(f"SELECT {agg}(at) AS t FROM ledger_events WHERE action_id = ANY(%s) AND event = %s",
                    (action_ids, event))
        return cur.fetchone()["t"]


def latency(stack: Any, action_id: str) -> float:
    return (event_at(stack, [action_id], "final_state", "max")
            - event_at(stack, [action_id], "published", "min")).total_seconds()


def stages(stack: Any, action_id: str) -> dict[str, float]:
    """Where the latency went: waiting for the execute queue, executing, then the verification task
    (its queue wait included; 0 when the execute task's own read proved the verdict)."""
    at = {e: event_at(stack, [action_id], e, "min") for e in ("published", "validated", "verification_enqueued")}
    end = event_at(stack, [action_id], "final_state", "max")
    if None in (at["published"], at["validated"], end):
        return {}
    handed = at["verification_enqueued"] or end
    return {"execute_queue_s": round((at["validated"] - at["published"]).total_seconds(), 3),
            "execute_s": round((handed - at["validated"]).total_seconds(), 3),
            "verify_s": round((end - handed).total_seconds(), 3)}


def settled_count(stack: Any, action_ids: list[str]) -> int:
    from tests.conftest import SETTLED

    with stack.conn.cursor() as cur:
        cur.execute("SELECT count(*) AS n FROM actions WHERE action_id = ANY(%s) AND status = ANY(%s)",
                    (action_ids, [s.value for s in SETTLED]))
        return int(cur.fetchone()["n"])


def probe(stack: Any, tenant: str, burst_ids: list[str] | None = None) -> dict[str, Any]:
    env = ticket(stack, tenant)
    ahead = len(burst_ids) - settled_count(stack, burst_ids) if burst_ids else 0
    stack.publish(env)
    row = stack.wait_settled(env.action_id, timeout=600)
    return {"latency_s": round(latency(stack, env.action_id), 3), "outcome": str(row.outcome),
            **stages(stack, env.action_id),
            "burst_unsettled_at_publish": ahead,
            "burst_unsettled_at_settle": len(burst_ids) - settled_count(stack, burst_ids) if burst_ids else 0}


def probing_tenant(shards: int, same_shard: bool) -> str:
    """``quiet``, or the first ``quiet-N`` on the burst's shard."""
    from proofline.shards import shard_of

    if not same_shard:
        return "quiet"
    return next(f"quiet-{i}" for i in range(10_000) if shard_of(f"quiet-{i}", shards) == shard_of("noisy", shards))


def run(burst: int, probes: int, shards: int, same_shard: bool = False, fair_share: int = 1) -> dict[str, Any]:
    os.environ["PROOFLINE_TENANT_SHARDS"] = str(shards)  # the publishing side (this process)
    from tests.conftest import build_stack, start_workers, teardown_stack, wait_for

    quiet = probing_tenant(shards, same_shard)
    stack = build_stack("http", Path(tempfile.mkdtemp(prefix="fairness-bench-")),
                        extra_env={"PROOFLINE_TENANT_SHARDS": str(shards),
                                   "PROOFLINE_TENANT_FAIR_SHARE": str(fair_share)})
    try:
        start_workers(stack, beat=False)
        for env in [ticket(stack, "warmup") for _ in range(6)]:
            stack.publish(env)
            stack.wait_settled(env.action_id, timeout=120)
        alone = [probe(stack, quiet) for _ in range(probes)]

        envs = [ticket(stack, "noisy") for _ in range(burst)]
        for env in envs:
            stack.publish(env)
        ids = [e.action_id for e in envs]
        loaded = [probe(stack, quiet, ids) for _ in range(probes)]
        wait_for(lambda: settled_count(stack, ids) == burst, 3600, interval=1.0, what="the burst to settle")
        wall = (event_at(stack, ids, "final_state", "max") - event_at(stack, ids, "published", "min")).total_seconds()
        task_time = wall * SLOTS / burst
        unloaded_s = statistics.mean(p["latency_s"] for p in alone)
        loaded_s = statistics.mean(p["latency_s"] for p in loaded)
        bound = 2 * unloaded_s + task_time
        return {
            "burst": burst, "probes": probes, "shards": shards, "slots": SLOTS, "same_shard": same_shard,
            "fair_share": fair_share, "yields": yields(stack, ids),
            "unloaded_latency_s": round(unloaded_s, 3), "loaded_latency_s": round(loaded_s, 3),
            "ratio": round(loaded_s / unloaded_s, 2), "burst_wall_s": round(wall, 1),
            "mean_task_time_s": round(task_time, 3), "bound_s": round(bound, 3),
            "worst_loaded_latency_s": max(p["latency_s"] for p in loaded),
            "meets_target": max(p["latency_s"] for p in loaded) <= bound,
            "alone": alone, "loaded": loaded,
        }
    finally:
        teardown_stack(stack)


def yields(stack: Any, action_ids: list[str]) -> int:
    """Turns the burst gave to the probing tenant (``tenant_fair_wait`` records)."""
    with stack.conn.cursor() as cur:
        cur.execute("SELECT count(*) AS n FROM ledger_events WHERE action_id = ANY(%s) AND event = 'tenant_fair_wait'",
                    (action_ids,))
        return int(cur.fetchone()["n"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=500)
    parser.add_argument("--probes", type=int, default=3)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--same-shard", action="store_true")
    parser.add_argument("--fair-share", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    started = time.monotonic()
    result = run(args.burst, args.probes, args.shards, args.same_shard, args.fair_share)
    result["run_seconds"] = round(time.monotonic() - started, 1)
    for key in ("burst", "shards", "same_shard", "fair_share", "yields", "unloaded_latency_s", "loaded_latency_s", "worst_loaded_latency_s", "ratio",
                "burst_wall_s", "mean_task_time_s", "bound_s", "meets_target"):
        print(f"{key:>24}: {result[key]}")
    for name in ("alone", "loaded"):
        print(f"{name:>24}: {result[name]}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
