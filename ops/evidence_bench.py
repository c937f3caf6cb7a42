"""What one independent evidence source costs: throughput of the standard action verified by the
system of record alone against the same action confirmed by the audit system too, in one run.

    .venv/bin/python -m ops.evidence_bench [--actions 200] [--rounds 3] [--transport stdio] [--json PATH]

One stack (Postgres, Redis, the demo system of record, the audit system with its feed lagging by the
stack's ``AUDIT_DELAY_MS``, one worker with the runtime's own timings) and one contracts folder with
two action types that differ only in their verification:

- ``one``: ``ticket.create`` as shipped: the record's own read (the execute task may decide in place).
- ``two``: ``ticket.create.audited``: the same, plus an ``audit`` source (``find_audit_entries`` on
  the audit server, through its read identity) that must confirm (rule ``all``). The verdict waits
  for the audit log to catch up, in the verification task.

Windows alternate ``one`` then ``two``, ``--rounds`` times, on the same worker; each publishes
``--actions`` envelopes through the SDK's batched path and measures verified actions per second
between the first ``published`` and the last ``final_state`` ledger timestamps (database clock).
The figure reported is the median of the per-round ratios two/one, with the median time from
``published`` to ``final_state`` on each side.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ops.authority_bench import window
from ops.bench import runtime_defaults, window_arguments
from proofline.settings import ROOT
from proofline_kit.stack import Stack, build_stack, start_workers, teardown_stack

AUDITED = "ticket.create.audited"
SIDES = {"one": "ticket.create", "two": AUDITED}


def log(message: str) -> None:
    print(f"[evidence-bench] {message}", file=sys.stderr, flush=True)


def contracts(directory: Path) -> Path:
    """The shipped contracts plus ``ticket.create.audited``: ticket.create with an audit source."""
    shutil.copytree(ROOT / "contracts", directory)
    spec = yaml.safe_load((directory / "ticket.create.yaml").read_text())
    spec["action_type"] = AUDITED
    spec["verification"]["sources"] = [{
        "name": "audit", "server": "audit", "tool": "find_audit_entries",
        "arguments": {"idempotency_key": "envelope.idempotency_key"}, "consistency_delay_seconds": 2,
        "expected": ["after.count == 1"], "prohibited": ["after.count > 1"], "absent": "after.count == 0"}]
    spec["verification"]["evidence"] = {"rule": "all"}
    (directory / f"{AUDITED}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return directory


def envelopes(stack: Stack, action_type: str, count: int, label: str) -> list[Any]:
    return [stack.envelope(action_type, arguments={"tenant": "acme", "title": f"{label}-{i}", "owner": "ops"},
                           target={"type": "ticket_queue", "id": f"{label}-{i}"}) for i in range(count)]


def latency(stack: Stack, ids: list[str]) -> float:
    """Median seconds from ``published`` to ``final_state`` of ``ids``."""
    with stack.conn.cursor() as cur:
        cur.execute("""SELECT extract(epoch FROM f.at - p.at)::float8 AS s FROM ledger_events p
                         JOIN ledger_events f ON f.action_id = p.action_id AND f.event = 'final_state'
                        WHERE p.event = 'published' AND p.action_id = ANY(%s)""", (ids,))
        return statistics.median(r["s"] for r in cur.fetchall())


def measure(stack: Stack, args: argparse.Namespace) -> int:
    """Warm both sides up, run the alternating windows, print the figures; 1 if any action failed."""
    start_workers(stack, count=1, concurrency=args.concurrency)
    for side, action_type in SIDES.items():
        window(stack, envelopes(stack, action_type, args.warmup, f"warm-{side}"))
    rounds = []
    for n in range(args.rounds):
        result: dict[str, Any] = {}
        for side, action_type in SIDES.items():
            log(f"round {n + 1}/{args.rounds}: {side}")
            envs = envelopes(stack, action_type, args.actions, f"run-{side}-{n}")
            result[side] = window(stack, envs)
            result[side]["median_seconds_to_final"] = latency(stack, [e.action_id for e in envs])
            log(f"  {result[side]['actions_per_second']:.1f} actions/s ({result[side]['verified']} verified)")
        result["ratio"] = result["two"]["actions_per_second"] / result["one"]["actions_per_second"]
        rounds.append(result)
    ratio = statistics.median(r["ratio"] for r in rounds)
    print(f"throughput with an audit source / without (median of {args.rounds} rounds): {ratio:.3f} "
          f"(audit delay {stack.env.get('AUDIT_DELAY_MS')} ms, concurrency {args.concurrency})")
    for i, r in enumerate(rounds, 1):
        print(f"  round {i}: one source {r['one']['actions_per_second']:.1f}/s "
              f"(median {r['one']['median_seconds_to_final']:.2f} s to final), two sources "
              f"{r['two']['actions_per_second']:.1f}/s (median {r['two']['median_seconds_to_final']:.2f} s), "
              f"ratio {r['ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"ratio_two_one": ratio, "rounds": rounds,
                                         "config": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    unverified = sum(r[side]["actions"] - r[side]["verified"] for r in rounds for side in SIDES)
    if unverified:
        log(f"ERROR: {unverified} actions not verified")
    return 1 if unverified else 0


def main(argv: list[str] | None = None) -> int:
    args = window_arguments(__doc__.splitlines()[0], "stdio").parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="proofline-evidence-bench-"))
    stack = build_stack(args.transport, tmp, extra_env={
        **runtime_defaults(), "PROOFLINE_FAULT_POINTS_ENABLED": "false",
        "PROOFLINE_CONTRACTS_DIR": str(contracts(tmp / "contracts"))})
    try:
        return measure(stack, args)
    finally:
        teardown_stack(stack)


if __name__ == "__main__":
    sys.exit(main())
