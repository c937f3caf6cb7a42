"""What the redaction policy and the seal cost per action, against a baseline in the same run.

Baseline: the exact-name redaction the ledger used before (a set lookup per key). Measured: the
policy (word-part names, declared names, card/bearer/PEM patterns, the action's secret values) on
the evidence one ``ticket.create`` action writes, and sealing + opening its signed message.

    python -m ops.redact_bench [--rounds 2000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from ledger import seal
from ledger.redact import for_envelope
from proofline.settings import Settings

ARGS = {"tenant": "acme", "title": "disk full on db-7", "owner": "ops", "api_key": "sk-live-0123456789abcdef"}
ENVELOPE = {"action_id": "act-1", "run_id": "run-1", "arguments": ARGS, "arguments_hash": "ab" * 32,
            "idempotency_key": "pl1-" + "cd" * 24, "evidence": {"redact_fields": ["password", "token", "secret"]},
            "approval": {"id": "apr-1", "version": 1, "expires_at": "2026-11-30T20:00:00+00:00"}}
TICKET = {"found": True, "ticket": {"id": "T-12", "tenant": "acme", "title": "disk full on db-7", "owner": "ops",
                                    "status": "open", "version": 1, "idempotency_key": "pl1-" + "cd" * 24}}
#: The evidence of one verified action (published … final_state), as the ledger writes it.
EVENTS: list[dict[str, Any]] = [
    {"run_id": "run-1", "arguments": ARGS, "arguments_hash": "ab" * 32, "idempotency_key": "pl1-" + "cd" * 24},
    {"key_id": "dev-1", "contract": "ticket.create", "contract_digest": "ef" * 32, "task_id": "t-1"},
    {"approval_expires_at": "2026-11-30T20:00:00+00:00", "policy_version": 5, "tool_contract_hash": "01" * 32},
    {"fencing_token": 17, "worker_id": "host:123", "target": "acme:ticket_queue:acme-ops", "ttl_seconds": 4},
    {"key": "pl1-" + "cd" * 24, "fencing_token": 17}, {"before": {"found": False}},
    {"outcome": "completed_unverified", "elapsed_ms": 12.5, "result": {"ticket_id": "T-12", "status": "open"}},
    {"verification_key": "verify-pl1-" + "cd" * 24, "finding": "expected", "after": TICKET, "reads": 1},
]


def _baseline(value: Any, fields: frozenset[str]) -> Any:
    if isinstance(value, dict):
        return {k: ("[redacted]" if str(k).lower() in fields else _baseline(v, fields)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_baseline(v, fields) for v in value]
    return value


def _time(fn, rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    rounds = parser.parse_args().rounds
    fields = frozenset({"password", "token", "secret", "authorization", "api_key"})
    base = _time(lambda: [_baseline(e, fields) for e in EVENTS], rounds)
    policy = _time(lambda: (lambda red: [red(e) for e in EVENTS])(for_envelope(ENVELOPE, ["args.title"])), rounds)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seal.key"
        seal.write_key(path)
        key = seal.sealer_for(Settings(seal_key_file=path))
        message = {"envelope": ENVELOPE, "key_id": "dev-1", "signature": os.urandom(32).hex()}
        sealed = _time(lambda: seal.open_bytes("act-1", seal.seal_message(key, "act-1", message)), rounds)
    print(f"evidence of one action, {len(EVENTS)} events, {rounds} rounds")
    print(f"  exact-name redaction (baseline)   {base * 1e6:8.1f} us")
    print(f"  redaction policy                  {policy * 1e6:8.1f} us   ratio {policy / base:5.1f}x")
    print(f"  seal + open the signed message    {sealed * 1e6:8.1f} us   ratio {sealed / base:5.1f}x")


if __name__ == "__main__":
    main()
