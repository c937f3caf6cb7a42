"""Fuzz campaign for the message guard (not a CI test; tests/containment runs a small sample).

Two parts, both on real services:

1. ``validation``: damaged envelopes (hostile values anywhere: deep nesting, lone surrogates, NUL,
   huge integers, non-finite floats, self-references, objects whose ``repr`` raises, removed and
   retyped fields, bad signatures) through the wire decoder when they are JSON, then the worker's
   validation and refusal recording, in process, against a fresh migrated Postgres database.
   Counted: refused and recorded, accepted, and *unrecordable* (recording raised) - must be 0.
2. ``broker``: damaged raw messages (damaged envelopes, other content types, pickles, truncated and
   corrupted bytes, 940-deep bodies, hostile headers, other task names, protocol-1 bodies, and
   documents kombu itself cannot read pushed straight onto the Redis list) pushed to a real Redis
   with kombu and consumed by a real supervised Celery worker. Counted: messages
   with no ledger record (must be 0), consumer crashes (Celery main process replaced or supervisor
   restarts; must be 0).

    .venv/bin/python ops/fuzz.py --validation 100000 --broker 1000
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kombu import Connection  # noqa: E402

from ledger import store  # noqa: E402
from ops.fuzz_damage import damaged_message, raw_message  # noqa: E402
from proofline.bounded import safe_repr  # noqa: E402
from proofline.contracts import contract_for  # noqa: E402
from proofline.controller import signed_message  # noqa: E402
from proofline.envelope import build_envelope  # noqa: E402
from proofline.errors import EnvelopeRefused, MalformedEnvelope  # noqa: E402
from proofline.keys import generate as generate_keys  # noqa: E402
from proofline.settings import Settings  # noqa: E402
from worker import wire  # noqa: E402
from worker.execute import record_refusal  # noqa: E402
from worker.validate import validate_envelope  # noqa: E402


def good_message(settings: Settings) -> dict[str, Any]:
    """A correctly signed ticket.create message (the contract hash is a placeholder: validation
    checks the contract's tool, not the live hash)."""
    contract = contract_for(settings.contracts_dir, "ticket.create")
    now = datetime.now(UTC)
    uid = uuid.uuid4().hex[:10]
    env = build_envelope(
        run_id=f"run-{uid}", action_id=f"fuzz-{uid}", workflow_type="agent.ops", action_type="ticket.create",
        requester="fuzz@example.com", workload_identity="agent:fuzz", tenant="acme", environment="test",
        target={"type": "ticket_queue", "id": "acme-ops"}, operation=contract.operation,
        arguments={"tenant": "acme", "title": "fuzz", "owner": "ops"},
        server={"name": contract.server, "version": "1.0.0"}, tool={"name": contract.tool, "contract_hash": "0" * 64},
        policy_version=settings.accepted_policy_versions[-1],
        approval={"id": f"apr-{uid}", "version": 1, "expires_at": now + timedelta(hours=1)},
        timeout_seconds=contract.timeout_seconds, deadline=now + timedelta(minutes=10))
    return signed_message(settings, env)


def validate_and_record(rt: Any, message: Any, delivery: dict[str, Any]) -> str:
    """Exactly what the execute task does with a message before any lease: validate, and record a
    refusal. Returns "refused" or "accepted"; raises only if recording itself fails."""
    try:
        try:
            validate_envelope(message, rt.settings, rt.contract)
        except EnvelopeRefused:
            raise
        except Exception as exc:  # noqa: BLE001 - as worker/execute.py: anything else is malformed
            raise MalformedEnvelope(f"unreadable envelope: {safe_repr(exc, 500)}") from exc
    except EnvelopeRefused as exc:
        record_refusal(rt, message, exc, delivery)
        return "refused"
    return "accepted"


def validation_campaign(count: int, seed: int, database_url: str, settings: Settings) -> dict[str, Any]:
    rng = random.Random(seed)
    if settings.signing_key_file is None:
        # A campaign of its own: development keys in a scratch folder sign the undamaged message.
        keys_dir = Path(tempfile.mkdtemp(prefix="proofline-fuzz-keys-"))
        generate_keys(keys_dir, force=True, development=True)
        settings = settings.model_copy(update={"keys_dir": keys_dir, "signing_key_file": keys_dir / "controller.key",
                                               "keyring_file": keys_dir / "keyring.json",
                                               "recovery_key_file": keys_dir / "recovery.key",
                                               "seal_key_file": keys_dir / "seal.key"})
    good = good_message(settings)
    rt = SimpleNamespace(settings=settings, conn=store.connect(database_url),
                         contract=lambda t: contract_for(settings.contracts_dir, t))
    counts = {"damaged": 0, "refused_recorded": 0, "accepted": 0, "unrecordable": 0, "through_wire": 0}
    failures: list[str] = []
    started = time.monotonic()
    for i in range(count):
        json_only = rng.random() < 0.5
        message = damaged_message(rng, good, json_only)
        counts["damaged"] += 1
        if json_only:
            try:
                args, _, _ = wire.loads(wire.dumps([[message], {}, {}]).encode())
                message = args[0] if args else message
                counts["through_wire"] += 1
            except (ValueError, RecursionError):
                pass  # not encodable (a huge int, deep nesting): the producer could not send it either
        try:
            counts[{"refused": "refused_recorded", "accepted": "accepted"}[
                validate_and_record(rt, message, {"task_id": f"fuzz-{seed}-{i}", "redelivered": False})]] += 1
        except Exception as exc:  # noqa: BLE001 - the figure this campaign exists to measure
            counts["unrecordable"] += 1
            if len(failures) < 10:
                failures.append(f"#{i}: {type(exc).__name__}: {safe_repr(exc, 200)}")
            if rt.conn.broken or rt.conn.closed:
                rt.conn = store.connect(database_url)
    with rt.conn.cursor() as cur:
        cur.execute("SELECT count(*) AS n FROM ledger_events WHERE event = 'envelope_refused'")
        counts["refusal_events_in_ledger"] = cur.fetchone()["n"]
    rt.conn.close()
    return {**counts, "seconds": round(time.monotonic() - started, 1), "failures": failures}


def broker_campaign(count: int, seed: int, workdir: Path) -> dict[str, Any]:
    from tests.conftest import build_stack, start_workers, teardown_stack, wait_for
    from tests.containment.helpers import celery_main_pid, worker_starts

    rng = random.Random(seed)
    stack = build_stack("stdio", workdir)
    try:
        start_workers(stack)
        good = stack.message(stack.envelope("ticket.create", arguments={"tenant": "acme", "title": "fuzz",
                                                                       "owner": "ops"},
                                            target={"type": "ticket_queue", "id": "acme-ops"}))
        main_pid = celery_main_pid(stack)
        sent: dict[str, tuple[str, str]] = {}  # task id -> (body digest, kind)
        started = time.monotonic()
        with Connection(stack.broker_url) as conn:
            producer = conn.Producer()
            for i in range(count):
                nonce = f"fuzz-{seed}-{i}-{uuid.uuid4().hex[:8]}"
                raw = raw_message(rng, good, nonce)
                task_id = str(uuid.uuid4())
                headers = {"lang": "py", "task": raw.task, "id": task_id, "root_id": task_id, "parent_id": None,
                           "retries": 0, "argsrepr": "()", "kwargsrepr": "{}", **raw.headers}
                if raw.document is not None:
                    # Straight onto the list: a document kombu itself cannot read.
                    conn.default_channel.client.lpush("actions", raw.document)
                    sent[task_id] = (wire.digest(wire.QUARANTINE_PREFIX + raw.document), "document")
                    continue
                producer.publish(raw.body, exchange="", routing_key="actions", content_type=raw.content_type or None,
                                 content_encoding="binary", headers=headers, serializer=None)
                sent[task_id] = (wire.digest(raw.body), f"{raw.task} {raw.content_type!r} headers={sorted(raw.headers)} "
                                                        f"body={raw.body[:60]!r}")

        def unrecorded() -> list[str]:
            with stack.conn.cursor() as cur:
                cur.execute("SELECT DISTINCT evidence->>'task_id' AS t FROM ledger_events WHERE evidence ? 'task_id'")
                ids = {r["t"] for r in cur.fetchall()}
                cur.execute("SELECT DISTINCT evidence->>'message_digest' AS d FROM ledger_events "
                            "WHERE evidence ? 'message_digest'")
                digests = {r["d"] for r in cur.fetchall()}
            return [t for t, (d, _) in sent.items() if t not in ids and d not in digests]

        try:
            wait_for(lambda: not unrecorded(), timeout=max(120.0, count * 0.5), interval=1.0, what="every record")
        except AssertionError:
            pass
        missing = [f"{t}: {sent[t][1]}" for t in unrecorded()]
        with stack.conn.cursor() as cur:
            cur.execute("SELECT evidence->>'reason_code' AS r, count(*) AS n FROM ledger_events "
                        "WHERE event = 'envelope_refused' GROUP BY 1 ORDER BY 2 DESC")
            reasons = {r["r"]: r["n"] for r in cur.fetchall()}
        return {
            "messages": count, "without_record": len(missing), "missing_examples": missing[:5],
            "consumer_replaced": celery_main_pid(stack) != main_pid, "worker_starts": worker_starts(stack),
            "workers_alive": stack.workers_alive(), "refusal_reasons": reasons,
            "seconds": round(time.monotonic() - started, 1),
        }
    finally:
        teardown_stack(stack)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--validation", type=int, default=100_000)
    parser.add_argument("--broker", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--workdir", type=Path, help="keep the broker campaign's logs here")
    args = parser.parse_args()
    from tests.conftest import create_database, drop_database

    report: dict[str, Any] = {"seed": args.seed}
    if args.validation:
        admin, runtime_url = create_database("pl_fuzz")
        try:
            report["validation"] = validation_campaign(args.validation, args.seed, runtime_url, Settings())
        finally:
            drop_database(admin)
    if args.broker:
        if args.workdir:
            args.workdir.mkdir(parents=True, exist_ok=True)
            report["broker"] = broker_campaign(args.broker, args.seed, args.workdir)
        else:
            with tempfile.TemporaryDirectory(prefix="proofline-fuzz-") as tmp:
                report["broker"] = broker_campaign(args.broker, args.seed, Path(tmp))
    print(json.dumps(report, indent=2))
    v, b = report.get("validation", {}), report.get("broker", {})
    ok = v.get("unrecordable", 0) == 0 and b.get("without_record", 0) == 0 and not b.get("consumer_replaced") \
        and b.get("worker_starts", 1) == 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
