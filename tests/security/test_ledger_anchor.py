"""Signed ledger checkpoints against an attacker who owns the database.

A real stack (Postgres, Redis, Celery workers, the system-of-record MCP server) produces real
action chains and refusal chains; the workers are then stopped and each test works on its own copy
of that database (CREATE DATABASE … TEMPLATE) with its own checkpoint store. Tampering is done as
the table owner does it: ``session_replication_role = replica`` or ``DISABLE TRIGGER USER``, then
rewrite, rehash with ``ledger_event_hash()`` and move the anchor on ``actions``. Every case is
checked through the Python function and through ``proofline verify-ledger`` run as a subprocess.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger import store
from ledger.anchor_check import LedgerReport, verify_ledger
from ledger.anchor_keys import SigningKey, load_public_keys
from ledger.anchor_store import store_for
from ledger.checkpoint import RECORD_CHAIN, build, recorded_checkpoints, write_checkpoint
from proofline.errors import LedgerKeyUnavailable
from proofline.keys import KeyRole
from proofline.ledger_check import check_chains
from proofline.settings import ROOT, Settings
from proofline_kit import zygote
from tests.conftest import (
    ADMIN_URL,
    Stack,
    build_stack,
    drop_database,
    start_process,
    start_workers,
    stop_process,
    teardown_stack,
    wait_for,
    with_database,
)
from tests.helpers import ticket_env

KEY_ID = "ledger-test-1"


def write_keys(directory: Path, key_id: str = KEY_ID, keyring: bool = True) -> Ed25519PrivateKey:
    """Key files in the agreed format: ledger.key (0600) and keyring.json."""
    directory.mkdir(parents=True, exist_ok=True)
    private = Ed25519PrivateKey.generate()
    key_file = directory / "ledger.key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"key_id": key_id, "role": "ledger",
                   "private_key": base64.b64encode(private.private_bytes_raw()).decode()}, handle)
    if keyring:
        public = base64.b64encode(private.public_key().public_bytes_raw()).decode()
        (directory / "keyring.json").write_text(json.dumps({"keys": [
            {"key_id": key_id, "role": "ledger", "public_key": public, "not_after": None, "revoked": False}]}))
    return private


@dataclass
class Source:
    stack: Stack
    keys: Path
    actions: list[str]
    refused: list[str]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    tmp = tmp_path_factory.mktemp("anchor")
    # Not the stack's own keys folder (build_stack writes a fresh development key set there).
    keys = tmp / "ledger-keys"
    write_keys(keys)
    stack = build_stack("stdio", tmp)
    try:
        start_workers(stack)
        envs = [ticket_env(stack) for _ in range(3)]
        for env in envs:
            stack.publish(env)
        stack.deliver({"envelope": {"action_id": "forged-1"}, "signature": "nope"})
        stack.deliver(["not", "an", "envelope"])
        for env in envs:
            assert stack.wait_settled(env.action_id).outcome is not None

        def two_refusals() -> list[str] | None:
            ids = sorted({r["action_id"] for r in stack.refusals()})
            return ids if len(ids) == 2 else None

        refused = wait_for(two_refusals, 30, what="two refusal chains")
        # A quiet ledger from here on: no worker writes to it, and it can serve as a template.
        for worker in stack.workers:
            stop_process(worker)
        stack.conn.close()
        yield Source(stack, keys, [e.action_id for e in envs], refused)
    finally:
        teardown_stack(stack)


@dataclass
class Ledger:
    name: str
    admin_url: str
    runtime_url: str
    settings: Settings
    source: Source

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")}
        env.update({"PROOFLINE_DATABASE_URL": self.runtime_url, "PYTHONPATH": str(ROOT),
                    "PROOFLINE_KEYS_DIR": str(self.settings.keys_dir),
                    "PROOFLINE_CHECKPOINT_DIR": str(self.settings.checkpoint_dir), **extra})
        return env

    def checkpoint(self, settings: Settings | None = None) -> dict[str, Any]:
        with store.connect(self.runtime_url) as conn:
            return write_checkpoint(conn, settings or self.settings, actor="test")

    def verify(self) -> LedgerReport:
        with store.connect(self.runtime_url) as conn:
            return verify_ledger(conn, self.settings)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return zygote.run([sys.executable, "-m", "proofline", *args], env=self.env(), cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    def append(self, chain: str, n: int) -> None:
        """Honest growth, through the runtime role like any worker."""
        with store.connect(self.runtime_url) as conn, store.transaction(conn) as cur:
            for i in range(n):
                store.append_event_txn(cur, chain, f"later-{i}", "test", {"i": i})

    def events(self, chain: str) -> int:
        with store.connect(self.admin_url) as conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) AS n FROM ledger_events WHERE action_id = %s", (chain,))
            return int(cur.fetchone()["n"])

    @property
    def store_dir(self) -> Path:
        return Path(store_for(self.settings, self.name).location)

    def self_check(self) -> list[tuple[str, int]]:
        """The check verify-ledger had before checkpoints (chains and actions anchors only)."""
        with store.connect(self.admin_url) as conn:
            return [(b.action_id, b.seq) for b in check_chains(conn)[2]]


@pytest.fixture
def ledger(source: Source, tmp_path: Path) -> Iterator[Ledger]:
    template = source.stack.admin_url.rsplit("/", 1)[-1]
    name = f"pl_anchor_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        conn.execute(f'GRANT CONNECT ON DATABASE "{name}" TO proofline_runtime')
    admin, runtime = with_database(ADMIN_URL, name), with_database(ADMIN_URL, name, user="proofline_runtime")
    settings = Settings(database_url=runtime, keys_dir=source.keys, checkpoint_dir=tmp_path / "checkpoints")
    try:
        yield Ledger(name, admin, runtime, settings, source)
    finally:
        drop_database(admin)


# --- what the attacker does, as the table owner -----------------------------------------------------


def rewrite_and_rehash(admin_url: str, chain: str, seq: int) -> None:
    """Change one event's evidence, recompute every hash from it on, move the anchor on actions."""
    with store.connect(admin_url) as conn, store.transaction(conn) as cur:
        cur.execute("SET LOCAL session_replication_role = replica")  # no trigger fires
        cur.execute("""UPDATE ledger_events SET evidence = evidence || '{"note": "nothing to see"}'::jsonb
                       WHERE action_id = %s AND seq = %s""", (chain, seq))
        assert cur.rowcount == 1
        cur.execute("SELECT seq FROM ledger_events WHERE action_id = %s AND seq >= %s ORDER BY seq", (chain, seq))
        for (n,) in [(r["seq"],) for r in cur.fetchall()]:
            cur.execute("""UPDATE ledger_events e SET
                             prev_hash = COALESCE((SELECT p.hash FROM ledger_events p
                                                   WHERE p.action_id = e.action_id AND p.seq = e.seq - 1), '')
                           WHERE action_id = %s AND seq = %s""", (chain, n))
            cur.execute("""UPDATE ledger_events SET
                             hash = ledger_event_hash(prev_hash, action_id, seq, event, actor, at, evidence)
                           WHERE action_id = %s AND seq = %s""", (chain, n))
        _reanchor(cur, chain)


def _reanchor(cur: store.Cursor, chain: str) -> None:
    cur.execute("""UPDATE actions a SET ledger_seq = h.seq, ledger_head = h.hash
                   FROM (SELECT seq, hash FROM ledger_events WHERE action_id = %s ORDER BY seq DESC LIMIT 1) h
                   WHERE a.action_id = %s""", (chain, chain))


def delete_events(admin_url: str, chain: str, from_seq: int = 1) -> int:
    """Delete a chain's events from ``from_seq`` on with the owner's triggers off, and move the anchor."""
    with store.connect(admin_url) as conn, store.transaction(conn) as cur:
        cur.execute("ALTER TABLE ledger_events DISABLE TRIGGER USER")
        cur.execute("DELETE FROM ledger_events WHERE action_id = %s AND seq >= %s", (chain, from_seq))
        deleted = cur.rowcount
        cur.execute("ALTER TABLE ledger_events ENABLE TRIGGER USER")
        _reanchor(cur, chain)
    return deleted


def chmod_edit(path: Path, edit) -> None:
    body = json.loads(path.read_text())
    edit(body)
    path.chmod(0o640)
    path.write_text(json.dumps(body))


# --- assertions on both faces of verify-ledger --------------------------------------------------------


def assert_detected(lg: Ledger, expected: list[tuple[str, int]], says: str) -> LedgerReport:
    report = lg.verify()
    assert not report.ok
    assert [(b.action_id, b.seq) for b in report.broken] == expected, report.broken
    assert says in report.broken[0].problem, report.broken[0].problem
    done = lg.cli("verify-ledger")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("BROKEN")]
    assert [line.split(": ", 1)[0] for line in lines] == [f"BROKEN {c} at seq {s}" for c, s in expected], done.stdout
    as_json = lg.cli("verify-ledger", "--json")
    assert as_json.returncode == 1
    body = json.loads(as_json.stdout)
    assert body["ok"] is False and [(b["chain"], b["seq"]) for b in body["broken"]] == expected
    return report


# --- tests ---------------------------------------------------------------------------------------------


def test_an_untampered_ledger_verifies_and_grows_past_its_checkpoints(ledger: Ledger):
    action, refusal = ledger.source.actions[0], ledger.source.refused[0]
    first = ledger.checkpoint()
    assert first["number"] == 1 and first["diverged"] == []
    # Every chain the stack wrote (actions, refusals, runs) is anchored at its full length.
    assert first["chains"] >= 5
    ledger.append(action, 2)
    ledger.append("act-new-after-checkpoint", 3)
    report = ledger.verify()
    assert report.ok, report.broken
    assert report.checkpoint and report.checkpoint["number"] == 1
    second = ledger.checkpoint()
    # The second checkpoint adds the growth and the record of the first checkpoint, nothing else.
    assert (second["number"], second["events"]) == (2, first["events"] + 2 + 3 + 1)
    ledger.append(action, 1)
    ledger.append(refusal, 1)
    report = ledger.verify()
    assert report.ok and report.checkpoint["number"] == 2 and report.checkpoints == 2
    done = ledger.cli("verify-ledger")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "against checkpoint 2" in done.stdout and done.stdout.rstrip().endswith("every chain verifies")
    assert json.loads(ledger.cli("verify-ledger", "--json").stdout)["ok"] is True


def test_a_rewritten_and_rehashed_chain_with_a_moved_anchor_is_named_at_the_changed_event(ledger: Ledger):
    action = ledger.source.actions[0]
    length = ledger.events(action)
    assert length >= 5
    ledger.checkpoint()
    rewrite_and_rehash(ledger.admin_url, action, 3)
    assert ledger.self_check() == []  # the chain agrees with itself and with its anchor
    assert_detected(ledger, [(action, 3)], "differs from the one checkpoint 1 anchored")
    # A later checkpoint does not launder the rewrite: it keeps the old anchor and says so.
    later = ledger.checkpoint()
    assert later["diverged"] == [action]
    assert_detected(ledger, [(action, 3)], "differs from the one checkpoint 1 anchored")


def test_a_deleted_refusal_chain_is_named(ledger: Ledger):
    refusal = ledger.source.refused[1]
    assert refusal.startswith("refused:")
    ledger.checkpoint()
    assert delete_events(ledger.admin_url, refusal) >= 1
    assert ledger.self_check() == []  # no actions row anchors a refusal chain
    assert_detected(ledger, [(refusal, 1)], "was deleted")


def test_a_truncated_chain_with_a_moved_anchor_is_named_at_its_first_missing_event(ledger: Ledger):
    action = ledger.source.actions[1]
    length = ledger.events(action)
    ledger.checkpoint()
    ledger.append(action, 1)  # growth after the checkpoint is cut too
    assert delete_events(ledger.admin_url, action, from_seq=length - 1) == 3
    assert ledger.self_check() == []
    assert_detected(ledger, [(action, length - 1)], f"events {length - 1}..{length} anchored by checkpoint 1")


@pytest.mark.parametrize(("edit", "says"), [
    (lambda body: body["leaves"][0].__setitem__(2, "0" * 64), "Merkle root"),
    (lambda body: body["statement"].update(events=body["statement"]["events"] - 1), "signature does not verify"),
])
def test_an_edited_checkpoint_file_is_named(ledger: Ledger, edit, says):
    ledger.checkpoint()
    ledger.append(ledger.source.actions[2], 1)
    ledger.checkpoint()
    chmod_edit(ledger.store_dir / "000000000001.json", edit)
    report = assert_detected(ledger, [("checkpoints", 1)], says)
    # The newer checkpoint still verifies and still guards the chains.
    assert report.checkpoint["number"] == 2


def test_a_deleted_latest_checkpoint_is_named_from_the_ledgers_record(ledger: Ledger):
    action = ledger.source.actions[2]
    ledger.checkpoint()
    ledger.append(action, 1)
    ledger.checkpoint()
    (ledger.store_dir / "000000000002.json").unlink()
    report = assert_detected(ledger, [("checkpoints", 2)], f"recorded at {RECORD_CHAIN} seq 2")
    assert "missing" in report.broken[0].problem
    assert report.checkpoint["number"] == 1  # the chains are still compared with checkpoint 1
    # Checkpointing goes on under a new number; the gap stays reported.
    assert ledger.checkpoint()["number"] == 3
    assert_detected(ledger, [("checkpoints", 2)], "missing")


def test_a_wiped_store_is_named_and_no_new_series_is_started(ledger: Ledger):
    ledger.checkpoint()
    ledger.checkpoint()
    shutil.rmtree(ledger.store_dir)
    report = assert_detected(ledger, [("checkpoints", 1)], "missing")
    assert report.checkpoint is None
    done = ledger.cli("checkpoint")
    assert done.returncode != 0 and "refusing to start a new series" in done.stderr
    assert not ledger.store_dir.exists()


@pytest.mark.parametrize("key_id", [KEY_ID, "rogue-key"])
def test_a_checkpoint_signed_by_a_wrong_key_is_refused(ledger: Ledger, tmp_path: Path, key_id: str):
    """The attacker rewrites a chain and replaces the checkpoint with one of their own that anchors
    the rewrite; without the ledger key the replacement does not verify."""
    action = ledger.source.actions[0]
    ledger.checkpoint()
    rewrite_and_rehash(ledger.admin_url, action, 2)
    rogue = SigningKey(key_id, KeyRole.ledger, Ed25519PrivateKey.generate())
    with store.connect(ledger.admin_url) as conn:
        forged = build(conn, ledger.name, None, 1, rogue)
    assert forged.statement["diverged"] == [] and (action, ledger.events(action)) in [
        (c, s) for c, s, _ in forged.leaves]
    target = ledger.store_dir / "000000000001.json"
    target.unlink()
    target.write_bytes(forged.to_bytes())
    says = "signature does not verify" if key_id == KEY_ID else "not a ledger key in the keyring"
    report = assert_detected(ledger, [("checkpoints", 1)], says)
    assert report.checkpoint is None
    # The checkpointer refuses to extend a series it cannot verify rather than start one anew.
    done = ledger.cli("checkpoint")
    assert done.returncode != 0 and "checkpoint_invalid" in done.stderr


def test_forged_checkpoint_records_in_the_ledger_are_named_not_trusted(ledger: Ledger):
    """The runtime role may append to any chain, the checkpoint records included."""
    ledger.checkpoint()
    with store.connect(ledger.runtime_url) as conn, store.transaction(conn) as cur:
        store.append_event_txn(cur, RECORD_CHAIN, "checkpoint_written", "mallory", {"number": "one", "hash": 7})
        cur.execute("SELECT evidence FROM ledger_events WHERE action_id = %s AND seq = 1", (RECORD_CHAIN,))
        genuine = cur.fetchone()["evidence"]
        # A copy of the genuine record with a higher number: the statement no longer matches its signature.
        store.append_event_txn(cur, RECORD_CHAIN, "checkpoint_written", "mallory",
                               {**genuine, "number": 99, "statement": {**genuine["statement"], "number": 99}})
    assert_detected(ledger, [(RECORD_CHAIN, 2)], "not a genuine checkpoint record")
    with store.connect(ledger.runtime_url) as conn:
        records = recorded_checkpoints(conn, load_public_keys(ledger.settings))
    assert [(r.seq, r.number) for r in records] == [(1, 1), (2, None), (3, None)]
    assert "signature does not verify" in (records[2].problem or "")
    # Forged records neither stop checkpointing nor move its numbering.
    assert ledger.checkpoint()["number"] == 2


def test_a_checkpoint_needs_the_ledger_key(ledger: Ledger, tmp_path: Path):
    keyless = Settings(database_url=ledger.runtime_url, keys_dir=tmp_path / "empty",
                       checkpoint_dir=ledger.settings.checkpoint_dir)
    with pytest.raises(LedgerKeyUnavailable, match="ledger key file") as info:
        ledger.checkpoint(keyless)
    assert info.value.code == "ledger_key_unavailable"
    # A key file whose key is not the keyring's key of that id signs nothing either.
    write_keys(tmp_path / "rogue", keyring=False)
    mismatched = Settings(database_url=ledger.runtime_url, keys_dir=ledger.settings.keys_dir,
                          ledger_key_file=tmp_path / "rogue" / "ledger.key",
                          checkpoint_dir=ledger.settings.checkpoint_dir)
    with pytest.raises(LedgerKeyUnavailable, match="not the keyring's key"):
        ledger.checkpoint(mismatched)
    assert not ledger.store_dir.exists()


def _checkpoint_worker(lg: Ledger, tag: str, **env: str) -> subprocess.Popen:
    stack = lg.source.stack
    argv = [sys.executable, "-m", "proofline", "worker", "--queues", "checkpoint", "--concurrency", "1",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", f"cp-{tag}-{uuid.uuid4().hex[:6]}@%h",
            "-B", "-s", str(stack.workdir / f"beat-cp-{tag}-{lg.name}.db")]
    full = {**stack.env, "PROOFLINE_DATABASE_URL": lg.runtime_url, "PROOFLINE_CHECKPOINT_INTERVAL_SECONDS": "1",
            "PROOFLINE_CHECKPOINT_DIR": str(lg.settings.checkpoint_dir), **env}
    return start_process(argv, full, stack.workdir / f"worker-cp-{tag}-{lg.name}.log")


def test_celery_beat_runs_checkpoints_in_a_real_worker(ledger: Ledger):
    stack = ledger.source.stack
    broker = redis.Redis.from_url(stack.broker_url)
    broker.delete("checkpoint")
    # A worker without the ledger key takes the task, refuses it with a clear code and keeps running.
    # The stack's development keys, less the ledger key (build_stack generates one with the rest).
    keyless_dir = stack.workdir / f"keys-no-ledger-{ledger.name}"
    shutil.copytree(stack.workdir / "keys", keyless_dir, ignore=shutil.ignore_patterns("ledger.key"))
    keyless = _checkpoint_worker(ledger, "keyless", PROOFLINE_KEYS_DIR=str(keyless_dir))
    log = stack.workdir / f"worker-cp-keyless-{ledger.name}.log"
    try:
        def refusals() -> int:
            return log.read_text(errors="replace").count("checkpoint refused: this worker holds no ledger key")

        wait_for(lambda: refusals() >= 1, 60, what="the keyless worker to refuse a checkpoint")
        # Another beat tick's checkpoint refused too: the worker lived on past the first refusal.
        wait_for(lambda: refusals() >= 2, 60, what="the keyless worker to refuse the next checkpoint")
        assert keyless.poll() is None
    finally:
        stop_process(keyless)
    assert not ledger.store_dir.exists()

    # The stack's development keys with this test's ledger key in place of the generated one.
    keyed_dir = stack.workdir / f"keys-ledger-{ledger.name}"
    shutil.copytree(keyless_dir, keyed_dir)
    shutil.copy2(ledger.settings.keys_dir / "ledger.key", keyed_dir / "ledger.key")
    ring = json.loads((keyed_dir / "keyring.json").read_text())
    ring["keys"] = [k for k in ring["keys"] if k["role"] != "ledger"] + json.loads(
        (ledger.settings.keys_dir / "keyring.json").read_text())["keys"]
    (keyed_dir / "keyring.json").write_text(json.dumps(ring))
    keyed = _checkpoint_worker(ledger, "keyed", PROOFLINE_KEYS_DIR=str(keyed_dir))
    try:
        wait_for(lambda: len(list(ledger.store_dir.glob("*.json"))) >= 2 if ledger.store_dir.exists() else False,
                 60, what="two beat-scheduled checkpoints")
    finally:
        stop_process(keyed)
    report = ledger.verify()
    assert report.ok, report.broken
    assert report.checkpoint["number"] >= 2
    with store.connect(ledger.runtime_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT actor, evidence FROM ledger_events WHERE action_id = %s ORDER BY seq", (RECORD_CHAIN,))
        records = cur.fetchall()
    assert [r["evidence"]["number"] for r in records][:2] == [1, 2]
    assert all(r["actor"] != "test" for r in records)  # written by the worker, not by this test
