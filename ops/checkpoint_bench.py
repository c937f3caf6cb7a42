"""What signed ledger checkpoints cost, against the chains' own self-check in the same run.

    .venv/bin/python -m ops.checkpoint_bench [--chains N] [--events M] [--growth PCT]

1. creates a migrated database and appends ``chains × events`` ledger events through the runtime
   role (the chain trigger does the hashing, as in production);
2. times the **baseline**: the self-check ``verify-ledger`` had before checkpoints
   (``proofline.ledger_check.check_chains``: every hash recomputed);
3. times the **first checkpoint** (reads and content-checks every event), appends ``--growth`` per
   cent more events, times an **incremental checkpoint** (only the new events), then the full
   ``verify_ledger`` (self-check + comparison with both checkpoints);
4. prints each as a ratio of the baseline, the checkpoint files' sizes, and tears down.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger import store
from ledger.anchor_check import verify_ledger
from ledger.anchor_store import store_for
from ledger.checkpoint import write_checkpoint
from proofline.ledger_check import check_chains
from proofline.settings import Settings
from tests.conftest import create_database, drop_database


def _keys(directory: Path) -> None:
    private = Ed25519PrivateKey.generate()
    fd = os.open(directory / "ledger.key", os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"key_id": "bench", "role": "ledger",
                   "private_key": base64.b64encode(private.private_bytes_raw()).decode()}, handle)
    public = base64.b64encode(private.public_key().public_bytes_raw()).decode()
    (directory / "keyring.json").write_text(json.dumps({"keys": [
        {"key_id": "bench", "role": "ledger", "public_key": public, "not_after": None, "revoked": False}]}))


def _append(url: str, chains: range, events: int) -> None:
    with store.connect(url) as conn, store.transaction(conn) as cur:
        for c in chains:
            cur.executemany("INSERT INTO ledger_events (action_id, event, actor, evidence) VALUES (%s, %s, %s, %s)",
                            [(f"bench-{c:06d}", f"step-{i}", "bench", json.dumps({"i": i, "pad": "x" * 80}))
                             for i in range(events)])


def _timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=2000)
    parser.add_argument("--events", type=int, default=10)
    parser.add_argument("--growth", type=float, default=1.0, help="per cent of chains that grow by --events")
    args = parser.parse_args(argv)
    admin, runtime = create_database("pl_cpbench")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            keys = Path(tmp) / "keys"
            keys.mkdir()
            _keys(keys)
            settings = Settings(database_url=runtime, keys_dir=keys, checkpoint_dir=Path(tmp) / "cp")
            _append(runtime, range(args.chains), args.events)
            with store.connect(runtime) as conn:
                base, _ = _timed(lambda: check_chains(conn))
                first, cp1 = _timed(lambda: write_checkpoint(conn, settings, "bench"))
                grown = max(1, int(args.chains * args.growth / 100))
                _append(runtime, range(grown), args.events)
                second, cp2 = _timed(lambda: write_checkpoint(conn, settings, "bench"))
                full, report = _timed(lambda: verify_ledger(conn, settings))
            assert report.ok, report.broken
            directory = Path(store_for(settings, admin.rsplit("/", 1)[-1]).location)
            sizes = [p.stat().st_size for p in sorted(directory.glob("*.json"))]
    finally:
        drop_database(admin)
    events = args.chains * args.events
    print(f"{args.chains} chains, {events} events; {grown} chains grew by {args.events} events")
    print(f"{'step':<42} {'seconds':>8} {'x baseline':>10}")
    for name, seconds in [("self-check (baseline)", base), ("first checkpoint (all events)", first),
                          (f"incremental checkpoint (+{grown * args.events} events)", second),
                          ("verify-ledger with checkpoints", full)]:
        print(f"{name:<42} {seconds:>8.3f} {seconds / base:>10.2f}")
    print(f"checkpoint files: {sizes[0]} and {sizes[1]} bytes "
          f"({sizes[0] / events:.0f} bytes/event in the first, {sizes[1] / args.chains:.0f} bytes/chain in the next)")
    print(json.dumps({"checkpoints": [cp1["number"], cp2["number"]]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
