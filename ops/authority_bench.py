"""What authority costs on the full path: throughput with signed approvals verified against the
same deployment without an authority policy, in one run.

    .venv/bin/python -m ops.authority_bench [--actions 200] [--rounds 3] [--transport http] [--json PATH]

One stack (Postgres, Redis, the demo system of record, one worker with the runtime's own timings)
runs alternating windows, ``off`` then ``on``, ``--rounds`` times, so that drift of the machine lands
on both sides alike:

- ``off``: the worker has no authority policy (mode ``unmanaged``): what the runtime did before.
- ``on``: the worker runs under a signed policy whose mode for the action type is ``approved``, and
  every envelope carries an approval signed by an approver key. The worker verifies the policy (once
  per file change), the approval's Ed25519 signature and binding, asks for its revocation and for a
  demotion of the type (one statement each), and records the authority evidence.

Each window publishes ``--actions`` ``ticket.create`` envelopes through the SDK's batched path and
measures verified actions per second between the first ``published`` and the last ``final_state``
ledger timestamps (database clock). Approvals are signed before the window (that is the approver's
work, not the runtime's). The worker is restarted for every window with the window's environment
and warmed up first. The figure reported is the median of the per-round ratios on/off; the target
of the authority work is at least 0.95.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ledger.states import ActionStatus
from ops.bench import runtime_defaults, window_arguments
from proofline.approvals import sign_approval, statement_for
from proofline.authority import AuthorityPolicy, sign_policy
from proofline.controller import publish_many
from proofline.keys import KeyRole, add_approver, load_signing_key
from proofline_kit.processes import stop_process, wait_for
from proofline_kit.stack import Stack, build_stack, start_workers, teardown_stack
from worker.dispatch import CeleryDispatch

TARGET = 0.95
BATCH = 50


def log(message: str) -> None:
    print(f"[authority-bench] {message}", file=sys.stderr, flush=True)


def envelopes(stack: Stack, count: int, label: str, key: Any | None) -> list[Any]:
    out = []
    for i in range(count):
        env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": f"{label}-{i}", "owner": "ops"},
                             target={"type": "ticket_queue", "id": f"{label}-{i}"})
        if key is not None:
            env = env.model_copy(update={"approvals": (sign_approval(
                statement_for(env, approver="bench-approver@example.com"), key),)})
        out.append(env)
    return out


def settle(stack: Stack, ids: list[str], timeout: float) -> None:
    settled = {ActionStatus.closed.value, ActionStatus.escalated.value}

    def done() -> bool:
        with stack.conn.cursor() as cur:
            cur.execute("SELECT count(*) AS n FROM actions WHERE action_id = ANY(%s) AND status::text = ANY(%s)",
                        (ids, list(settled)))
            return cur.fetchone()["n"] == len(ids)

    wait_for(done, timeout, interval=0.2, what=f"{len(ids)} actions to settle")


def window(stack: Stack, envs: list[Any]) -> dict[str, Any]:
    ids = [e.action_id for e in envs]
    dispatch = CeleryDispatch(stack.app, stack.settings.tenant_shards)
    for at in range(0, len(envs), BATCH):
        publish_many(stack.settings, stack.conn, dispatch, envs[at:at + BATCH])
    settle(stack, ids, timeout=60 + len(ids))
    with stack.conn.cursor() as cur:
        cur.execute("""SELECT count(*) FILTER (WHERE a.outcome = 'completed_verified') AS verified,
                              extract(epoch FROM max(f.at) - min(p.at))::float8 AS seconds
                         FROM actions a
                         JOIN ledger_events p ON p.action_id = a.action_id AND p.event = 'published'
                         JOIN ledger_events f ON f.action_id = a.action_id AND f.event = 'final_state'
                        WHERE a.action_id = ANY(%s)""", (ids,))
        row = cur.fetchone()
        cur.execute("SELECT count(*) AS n FROM ledger_events WHERE action_id = ANY(%s) AND event = 'revalidated' "
                    "AND evidence #>> '{authority,mode}' = 'approved'", (ids,))
        approved = cur.fetchone()["n"]
    return {"actions": len(ids), "verified": row["verified"], "seconds": row["seconds"],
            "actions_per_second": row["verified"] / row["seconds"] if row["seconds"] else None,
            "approved_mode_actions": approved}


def run_round(stack: Stack, args: argparse.Namespace, side: str, env: dict[str, str], key: Any | None,
              n: int) -> dict[str, Any]:
    worker = start_workers(stack, count=1, concurrency=args.concurrency, env=env)[0]
    try:
        warm = envelopes(stack, args.warmup, f"warm-{side}-{n}", key)
        window(stack, warm)
        measured = envelopes(stack, args.actions, f"run-{side}-{n}", key)
        return window(stack, measured)
    finally:
        stop_process(worker)
        stack.workers.remove(worker)


def main(argv: list[str] | None = None) -> int:
    args = window_arguments(__doc__.splitlines()[0], "http").parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="proofline-authority-bench-"))
    stack = build_stack(args.transport, tmp, extra_env={**runtime_defaults(), "PROOFLINE_FAULT_POINTS_ENABLED": "false"})
    try:
        add_approver(stack.settings.keyring_file, tmp / "approver.key", "bench-approver@example.com", development=True)
        key = load_signing_key(tmp / "approver.key", KeyRole.approver)
        policy_file = tmp / "authority.json"
        policy = AuthorityPolicy.model_validate({"version": 1, "action_types": {"ticket.create": {"mode": "approved"}}})
        policy_file.write_text(json.dumps(sign_policy(policy, key)))
        sides = {"off": (dict(stack.env), None), "on": ({**stack.env, "PROOFLINE_AUTHORITY_FILE": str(policy_file)}, key)}
        rounds = []
        for n in range(args.rounds):
            result = {}
            for side, (env, side_key) in sides.items():
                log(f"round {n + 1}/{args.rounds}: {side}")
                result[side] = run_round(stack, args, side, env, side_key, n)
                log(f"  {result[side]['actions_per_second']:.1f} actions/s ({result[side]['verified']} verified)")
            result["ratio"] = result["on"]["actions_per_second"] / result["off"]["actions_per_second"]
            rounds.append(result)
        ratio = statistics.median(r["ratio"] for r in rounds)
        bad = [r for r in rounds for side in ("on", "off") if r[side]["verified"] != r[side]["actions"]]
        wrong_mode = [r for r in rounds if r["on"]["approved_mode_actions"] != r["on"]["actions"]]
        print(f"authority on/off throughput ratio (median of {args.rounds} rounds): {ratio:.3f} (target >= {TARGET})")
        for i, r in enumerate(rounds, 1):
            print(f"  round {i}: off {r['off']['actions_per_second']:.1f}/s, on {r['on']['actions_per_second']:.1f}/s, "
                  f"ratio {r['ratio']:.3f}")
        if args.json:
            args.json.write_text(json.dumps({"ratio_on_off": ratio, "target": TARGET, "rounds": rounds,
                                             "config": {k: str(v) for k, v in vars(args).items()}}, indent=2))
        if bad or wrong_mode:
            log(f"ERROR: {len(bad)} windows with unverified actions, {len(wrong_mode)} 'on' windows not in approved mode")
            return 1
        return 0
    finally:
        time.sleep(0.1)
        teardown_stack(stack)


if __name__ == "__main__":
    sys.exit(main())
