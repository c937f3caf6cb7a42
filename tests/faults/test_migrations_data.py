"""Migrations stepped down and up again over a ledger that holds real, settled actions.

The actions run through real workers first; then the schema goes down to 0002 (the lowest
revision that keeps every ledger row) and back up to head, twice over different paths. What must
hold afterwards: every ledger event, action and idempotency record is still there, byte for byte
where it counts (hashes, heads, keys, signatures); ``proofline verify-ledger`` (chains and the signed
checkpoint written before the round trip) exits 0; the schema equals the declared metadata again;
and the role triggers are back, so a new action runs through the same workers and is verified.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import psycopg
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from psycopg.rows import dict_row
from sqlalchemy import create_engine

from ledger.migrate import current, downgrade, sqlalchemy_url, upgrade
from ledger.schema import metadata
from ledger.states import ActionStatus, Outcome
from proofline.settings import ROOT
from proofline_kit import zygote
from tests.conftest import Stack, build_stack, start_workers, stop_process, teardown_stack
from tests.helpers import new_account, refund_env, ticket_env

SNAPSHOT_SQL = {
    "events": "SELECT id, action_id, seq, event, actor, hash, prev_hash, evidence::text FROM ledger_events ORDER BY id",
    "actions": "SELECT action_id, status::text, outcome::text, reason_code, idempotency_key, key_id, signature, "
               "ledger_seq, ledger_head, published_at, envelope::text FROM actions ORDER BY action_id",
    "records": "SELECT key, status::text, attempts, fencing_token, argument_hash, result::text "
               "FROM idempotency_records ORDER BY key",
    "leases": "SELECT action_id, fencing_token, released_at FROM leases ORDER BY action_id",
}


def snapshot(admin_url: str) -> dict[str, list[dict[str, Any]]]:
    with psycopg.connect(admin_url, row_factory=dict_row) as conn:
        return {name: conn.execute(sql).fetchall() for name, sql in SNAPSHOT_SQL.items()}


def schema_diff(admin_url: str) -> list[Any]:
    engine = create_engine(sqlalchemy_url(admin_url))
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            return compare_metadata(context, metadata)
    finally:
        engine.dispose()


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, "-m", "proofline", *args], env=stack.env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_downgrade_and_upgrade_keep_the_ledger_and_its_proofs(tmp_path) -> None:
    s = build_stack("stdio", tmp_path, extra_env={"PROOFLINE_CHECKPOINT_DIR": str(tmp_path / "checkpoints")})
    try:
        start_workers(s)
        envs = [ticket_env(s), refund_env(s, new_account(s))]
        for env in envs:
            s.publish(env)
        for env in envs:
            assert s.wait_settled(env.action_id, timeout=60).outcome == Outcome.completed_verified
        for proc in list(s.workers):
            stop_process(proc)
        s.workers.clear()
        made = cli(s, "checkpoint")
        assert made.returncode == 0, made.stdout + made.stderr
        before = snapshot(s.admin_url)
        assert len(before["events"]) > 10 and len(before["actions"]) == 2
        effects_before = [s.effects(e.idempotency_key) for e in envs]
        calls_before = [s.witness.count(key=e.idempotency_key) for e in envs]

        # One step at a time to the oldest revision that keeps the ledger, then straight back up;
        # then straight down and up again, so each downgrade runs after an upgrade that re-created it.
        head = current(s.admin_url)  # the stack was migrated to head
        for down in ("0006", "0003", "0002"):
            downgrade(s.admin_url, down)
            assert current(s.admin_url) == down
        upgrade(s.admin_url)
        downgrade(s.admin_url, "0002")
        upgrade(s.admin_url)
        assert current(s.admin_url) == head

        after = snapshot(s.admin_url)
        for name in SNAPSHOT_SQL:
            assert after[name] == before[name], f"{name} changed across the migration round trip"
        assert schema_diff(s.admin_url) == []
        checked = cli(s, "verify-ledger", "--json")
        assert checked.returncode == 0, checked.stdout + checked.stderr
        report = json.loads(checked.stdout)
        assert report["events"] == len(before["events"]) and report["broken"] == []
        assert report["checkpoint"] is not None  # the chains were checked against the signed checkpoint too
        assert [s.effects(e.idempotency_key) for e in envs] == effects_before == [1, 1]
        assert calls_before == [1, 1]

        # The role guards came back with 0003: the migrated database runs a new action end to end.
        start_workers(s)
        fresh = ticket_env(s)
        s.publish(fresh)
        row = s.wait_settled(fresh.action_id, timeout=60)
        assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
        assert s.effects(fresh.idempotency_key) == 1
        assert s.witness.count(key=fresh.idempotency_key) == 1
        assert [s.witness.count(key=e.idempotency_key) for e in envs] == calls_before  # nothing re-run
        with psycopg.connect(s.urls["worker"]) as worker_conn:
            try:
                worker_conn.execute("UPDATE ledger_events SET actor = 'x' WHERE id = 1")
            except psycopg.Error as exc:
                refused = exc
            else:
                refused = None
        assert refused is not None, "the worker role may rewrite the ledger after the round trip"
    finally:
        teardown_stack(s)
