"""What signed evidence costs per action: the work a worker adds to a verdict's commit, and what
recovery adds before it derives, in the same process, on a ticket.create-sized result.

    .venv/bin/python -m ops.bench_evidence [--iterations 5000] [--repeats 5] [--database] [--json PATH]

Each figure is the fastest of ``--repeats`` timed loops of ``--iterations`` (after a warm-up loop),
in microseconds per action:

- ``worker_sign``: what a verdict adds in the worker: the stored (redacted, jsonb) form of the result
  and the after-snapshot, the statement with its digests, RFC 8785 canonical JSON and the Ed25519
  signature (``ledger.evidence.statement`` + ``signed_event``);
- ``ed25519_only``: the signature alone on the already canonicalised bytes;
- ``recovery_check``: what recovery adds per decision: the signature check against the keyring and
  the row compared with the statement (``verify_evidence`` + ``mismatches``); not on the happy path.

With ``--database`` (a scratch database on the local Postgres, dropped at the end), also the
ledger row itself: ``ledger_row_us``, the wall time of appending one ``evidence_signed`` row (its
chain hash included) inside an open transaction, one statement per row as here. On the real path
the row goes in the transition's own statement, so it adds no round trip and no commit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ledger import evidence
from ledger.redact import POLICY
from ledger.states import ActionStatus, Outcome
from ledger.store import ActionRow
from proofline.canonical import canonical_bytes
from proofline.keys import KeyRole, generate, load_keyring, load_signing_key
from proofline.signing import EVIDENCE_CONTEXT, verify_evidence

TICKET = {"id": "T-4211", "tenant": "acme", "title": "disk full on db-7", "owner": "ops", "status": "open",
          "version": 1, "tags": ["disk", "p2"], "created_by": "agent:ops-assistant"}


def _best(fn, iterations: int, repeats: int) -> float:
    for _ in range(min(iterations, 200)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(iterations):
            fn()
        best = min(best, time.perf_counter() - began)
    return best / iterations * 1e6


def measure(iterations: int, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        key = load_signing_key(Path(tmp) / "worker.key", KeyRole.worker)
        ring = load_keyring(Path(tmp) / "keyring.json")
    result = {"values": {"ticket": TICKET}}
    before = {"found": False}

    def sign_once() -> dict[str, Any]:
        after = evidence.as_stored({"after": {"found": True, "ticket": TICKET}}, POLICY)["after"]
        claims = evidence.statement(
            action_id="bench-1", idempotency_key="k" * 64, status=ActionStatus.closed,
            outcome=Outcome.completed_verified, finding="expected", reason_code="verified",
            result=evidence.as_stored(result, POLICY), recovery_data={"before": before, "after": after},
            signer="bench:1")
        return evidence.signed_event(key, claims)[1]

    seal = sign_once()
    now = datetime.now(UTC)
    row = ActionRow(action_id="bench-1", run_id="r", step=0, tenant="acme", action_type="ticket.create",
                    tool="create_ticket", idempotency_key="k" * 64, status=ActionStatus.recovery,
                    outcome=Outcome.completed_verified, finding="expected", reason_code="run_step_failed",
                    envelope={}, result=result, recovery_data={"before": before, "after": {"found": True,
                                                                                         "ticket": TICKET}},
                    deadline=now, published_at=now, updated_at=now)
    signed_bytes = EVIDENCE_CONTEXT + canonical_bytes(seal["statement"])

    def check_once() -> None:
        verify_evidence(seal, ring, None)
        assert not evidence.mismatches(row, seal["statement"], (ActionStatus.closed,))

    return {
        "iterations": iterations, "repeats": repeats,
        "worker_sign_us": round(_best(sign_once, iterations, repeats), 1),
        "ed25519_only_us": round(_best(lambda: key.sign(signed_bytes), iterations, repeats), 1),
        "recovery_check_us": round(_best(check_once, iterations, repeats), 1),
        "seal": seal,
    }


def measure_ledger_row(seal: dict[str, Any], rows: int, repeats: int) -> dict[str, Any]:
    """Per ``evidence_signed`` row, inside an open transaction (the commit it rides on is the
    verdict's own): the fastest of ``repeats`` batches of ``rows`` appends, each on a chain that
    already has events, rolled back after timing."""
    from ledger import store
    from proofline_kit.resources import create_database, drop_database

    admin, runtime = create_database("pl_bench_evidence")
    try:
        conn = store.connect(runtime)
        chains = [f"bench-{i}" for i in range(rows)]
        with store.transaction(conn) as cur:
            for chain in chains:
                store.append_events_txn(cur, chain, "bench", [("final_state", {"status": "closed"})])
        best = float("inf")
        for _ in range(repeats):
            with conn.transaction(force_rollback=True), conn.cursor() as cur:
                began = time.perf_counter()
                for chain in chains:
                    store.append_events_txn(cur, chain, "bench", [(evidence.EVENT, seal)])
                best = min(best, time.perf_counter() - began)
        conn.close()
    finally:
        drop_database(admin)
    return {"ledger_row_us": round(best / rows * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--database", action="store_true", help="also time the ledger row on the local Postgres")
    args = parser.parse_args(argv)
    figures = measure(args.iterations, args.repeats)
    if args.database:
        figures.update(measure_ledger_row(figures.pop("seal"), max(args.iterations // 10, 50), args.repeats))
    else:
        figures.pop("seal")
    print(json.dumps(figures, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
