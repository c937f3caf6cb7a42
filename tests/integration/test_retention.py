"""Retention pruning, export and MCP request ids, through a real stack.

A real stack (Postgres, Redis, Celery workers, the system-of-record MCP server over stdio) runs a
few actions; the workers then stop and each test works on its own copy of that database
(CREATE DATABASE ... TEMPLATE) with its own checkpoint store, through ``proofline`` subprocesses
connected as the roles a deployment uses (pruner, operator, reader, runtime).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from ledger import store
from ledger.export import KINDS, SCHEMA_VERSION, schema_markdown
from ledger.retention_ddl import PRUNE_CHAIN
from proofline.settings import ROOT
from proofline_kit import zygote
from tests.conftest import (
    ADMIN_URL,
    Stack,
    build_stack,
    drop_database,
    start_workers,
    stop_process,
    teardown_stack,
    with_database,
)
from tests.helpers import ticket_env
from tests.security.test_ledger_anchor import write_keys


@dataclass
class Source:
    stack: Stack
    keys: Path
    actions: list[str]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    tmp = tmp_path_factory.mktemp("retention")
    keys = tmp / "ledger-keys"
    write_keys(keys)
    stack = build_stack("stdio", tmp)
    try:
        start_workers(stack)
        envs = [ticket_env(stack) for _ in range(4)]
        for env in envs:
            stack.publish(env)
        for env in envs:
            assert stack.wait_settled(env.action_id).outcome is not None
        for worker in stack.workers:
            stop_process(worker)
        stack.conn.close()
        yield Source(stack, keys, [e.action_id for e in envs])
    finally:
        teardown_stack(stack)


@dataclass
class Copy:
    name: str
    admin: str
    checkpoints: Path
    source: Source

    def url(self, role: str) -> str:
        return with_database(ADMIN_URL, self.name, user=f"proofline_{role}")

    def cli(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")}
        env.update({"PYTHONPATH": str(ROOT), "PROOFLINE_DATABASE_URL": self.url("runtime"),
                    "PROOFLINE_PRUNER_DATABASE_URL": self.url("pruner"),
                    "PROOFLINE_OPERATOR_DATABASE_URL": self.url("operator"),
                    "PROOFLINE_READER_DATABASE_URL": self.url("reader"),
                    "PROOFLINE_KEYS_DIR": str(self.source.keys), "PROOFLINE_CHECKPOINT_DIR": str(self.checkpoints),
                    "PROOFLINE_CONTRACTS_DIR": self.source.stack.env.get("PROOFLINE_CONTRACTS_DIR",
                                                                         str(ROOT / "contracts")),
                    **extra})
        return zygote.run([sys.executable, "-m", "proofline", "--json", *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=180)

    def ok(self, *args: str, **extra: str) -> dict[str, Any]:
        done = self.cli(*args, **extra)
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout)

    def sql(self, query: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with store.connect(self.admin) as conn, conn.cursor() as cur:
            cur.execute(query, params)
            return list(cur.fetchall()) if cur.description else []


@pytest.fixture
def copy(source: Source, tmp_path: Path) -> Iterator[Copy]:
    template = source.stack.admin_url.rsplit("/", 1)[-1]
    name = f"pl_retain_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    admin = with_database(ADMIN_URL, name)
    with store.connect(admin) as conn:  # roles are cluster-wide; CONNECT is per database
        conn.execute(f'GRANT CONNECT ON DATABASE "{name}" TO proofline_runtime, proofline_pruner, '
                     'proofline_operator, proofline_reader, proofline_worker')
        conn.commit()
    try:
        yield Copy(name, admin, tmp_path / "checkpoints", source)
    finally:
        drop_database(admin)


def age(copy: Copy, days: float) -> None:
    """Let time pass for the settled actions: settled ``days`` ago, deadlines behind them."""
    copy.sql("UPDATE actions SET updated_at = clock_timestamp() - make_interval(days => %s), "
             "deadline = clock_timestamp() - interval '1 hour'", (days,))


def test_pruning_removes_whole_settled_chains_and_verify_ledger_stays_green(copy: Copy):
    held, *rest = copy.source.actions
    copy.ok("ledger", "hold", held, "--reason", "litigation 42")
    age(copy, 30)
    # Nothing is pruned before a checkpoint anchors the chains.
    early = copy.ok("ledger", "prune", PROOFLINE_RETENTION_STANDARD_DAYS="10")
    assert early["chains"] == 0 and early["not_anchored"] >= len(rest)
    first = copy.ok("checkpoint")
    before = {r["action_id"]: (r["ledger_seq"], r["ledger_head"]) for r in copy.sql(
        "SELECT action_id, ledger_seq, ledger_head FROM actions")}
    events = copy.sql("SELECT count(*) AS n FROM ledger_events")[0]["n"]
    # Kept for 60 days, settled 30 days ago: nothing is old enough.
    young = copy.ok("ledger", "prune", "--dry-run", PROOFLINE_RETENTION_STANDARD_DAYS="60")
    assert young["chains"] == 0
    dry = copy.ok("ledger", "prune", "--dry-run", PROOFLINE_RETENTION_STANDARD_DAYS="10")
    assert dry["dry_run"] is True and sorted(h[0] for h in dry["heads"]) == sorted(rest)
    assert copy.sql("SELECT count(*) AS n FROM ledger_events")[0]["n"] == events  # a dry run removes nothing
    done = copy.ok("ledger", "prune", PROOFLINE_RETENTION_STANDARD_DAYS="10")
    assert done["checkpoint"] == first["number"] and done["chains"] == len(rest)
    assert done["events"] == sum(before[a][0] for a in rest) and done["classes"] == {"standard": len(rest)}

    # The pruned chains are gone (rows and events); the held one is whole.
    left = {r["action_id"] for r in copy.sql("SELECT action_id FROM actions")}
    assert held in left and not left & set(rest)
    assert copy.sql("SELECT count(*) AS n FROM ledger_events WHERE action_id = ANY(%s)", (rest,))[0]["n"] == 0
    # The prune is recorded once, with each head as the checkpoint anchored it.
    records = copy.sql("SELECT actor, evidence FROM ledger_events WHERE action_id = %s", (PRUNE_CHAIN,))
    assert len(records) == 1 and records[0]["actor"] == "cli:prune"
    assert {h[0]: (h[1], h[2]) for h in records[0]["evidence"]["heads"]} == {a: before[a] for a in rest}

    report = copy.ok("verify-ledger")
    assert report["ok"] is True and any("pruned" in n for n in report["notes"]), report
    # The next checkpoint stops carrying the pruned chains, and nothing diverged.
    second = copy.ok("checkpoint")
    assert second["diverged"] == [] and second["chains"] == first["chains"] - len(rest) + 2  # + ledger:checkpoints, ledger:prunes
    assert copy.ok("verify-ledger")["ok"] is True
    # A second prune finds nothing more to do (the held chain stays whatever its age).
    again = copy.ok("ledger", "prune", PROOFLINE_RETENTION_STANDARD_DAYS="0")
    assert again["chains"] == 0 and held in {r["action_id"] for r in copy.sql("SELECT action_id FROM actions")}

    # An event removed from a kept chain is still found.
    with store.connect(copy.admin) as conn, store.transaction(conn) as cur:
        cur.execute("ALTER TABLE ledger_events DISABLE TRIGGER USER")
        cur.execute("DELETE FROM ledger_events WHERE action_id = %s AND seq = 2", (held,))
        cur.execute("ALTER TABLE ledger_events ENABLE TRIGGER USER")
    broken = copy.cli("verify-ledger")
    assert broken.returncode == 1, broken.stdout
    assert [b["chain"] for b in json.loads(broken.stdout)["broken"]] == [held]


def test_a_deleted_chain_is_not_passed_off_as_pruned(copy: Copy):
    victim = copy.source.actions[1]
    copy.ok("checkpoint")
    with store.connect(copy.admin) as conn, store.transaction(conn) as cur:
        cur.execute("ALTER TABLE ledger_events DISABLE TRIGGER USER")
        cur.execute("DELETE FROM ledger_events WHERE action_id = %s", (victim,))
        cur.execute("ALTER TABLE ledger_events ENABLE TRIGGER USER")
        cur.execute("DELETE FROM actions WHERE action_id = %s", (victim,))
    broken = copy.cli("verify-ledger")
    assert broken.returncode == 1
    assert [(b["chain"], b["seq"]) for b in json.loads(broken.stdout)["broken"]] == [(victim, 1)]


def test_a_prune_record_naming_another_head_does_not_cover_a_deletion(copy: Copy):
    """The owner deletes a chain and writes a prune record for it by hand, with a head that is not
    the one the checkpoint anchored (or a checkpoint that does not exist): still a deletion."""
    victim, other = copy.source.actions[1], copy.source.actions[2]
    copy.ok("checkpoint")
    [row] = copy.sql("SELECT ledger_seq FROM actions WHERE action_id = %s", (victim,))
    with store.connect(copy.admin) as conn, store.transaction(conn) as cur:
        cur.execute("ALTER TABLE ledger_events DISABLE TRIGGER USER")
        cur.execute("DELETE FROM ledger_events WHERE action_id = ANY(%s)", ([victim, other],))
        cur.execute("ALTER TABLE ledger_events ENABLE TRIGGER USER")
        cur.execute("DELETE FROM actions WHERE action_id = ANY(%s)", ([victim, other],))
        store.append_event_txn(cur, PRUNE_CHAIN, "ledger_pruned", "owner", {
            "checkpoint": 1, "heads": [[victim, row["ledger_seq"], "0" * 64]]})
        store.append_event_txn(cur, PRUNE_CHAIN, "ledger_pruned", "owner", {
            "checkpoint": 7, "heads": [[other, 1, "0" * 64]]})
    broken = copy.cli("verify-ledger")
    assert broken.returncode == 1
    found = {b["chain"]: b["problem"] for b in json.loads(broken.stdout)["broken"]}
    assert set(found) == {victim, other}, found
    # Reported at its first event; the record naming checkpoint 7 is named too.
    assert "was deleted" in found[victim] and "does not exist" in found[other], found


def test_only_the_pruning_role_may_prune(copy: Copy):
    for role in ("runtime", "worker", "operator", "reader"):
        with store.connect(copy.url(role)) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT proofline_prune('{}', '{}', '{}', 0, '{}', '{}', 'x', false)")
    # The insert-only trigger's exemption is the owner's alone: the setting does nothing for a role.
    with store.connect(copy.url("runtime")) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("SELECT set_config('proofline.pruning', 'on', false)")
        conn.execute("DELETE FROM ledger_events WHERE action_id = %s", (copy.source.actions[0],))
    # And no role may append a prune record of its own.
    with store.connect(copy.url("worker")) as conn, pytest.raises(psycopg.Error, match="not allowed"):
        conn.execute("INSERT INTO ledger_events (action_id, event, actor) VALUES (%s, 'ledger_pruned', 'x')",
                     (PRUNE_CHAIN,))


def _ledger_counts(copy: Copy) -> dict[str, int]:
    return {
        "actions": copy.sql("SELECT count(*) AS n FROM actions WHERE status::text IN "
                            "('closed', 'cancelled', 'escalated')")[0]["n"],
        "events": copy.sql("SELECT count(*) AS n FROM ledger_events")[0]["n"],
        "findings": copy.sql("SELECT count(*) AS n FROM ledger_events WHERE event IN "
                             "('evidence_read', 'verification_finished', 'evidence_signed')")[0]["n"],
    }


def test_export_reads_back_with_pyarrow_and_json(copy: Copy, tmp_path: Path):
    import pyarrow.parquet as pq

    counts = _ledger_counts(copy)
    assert counts["findings"] >= len(copy.source.actions)
    parquet = copy.ok("ledger", "export", "--format", "parquet", "--out", str(tmp_path / "pq"))
    jsonl = copy.ok("ledger", "export", "--format", "jsonl", "--out", str(tmp_path / "jl"))
    for kind in KINDS:
        table = pq.read_table(tmp_path / "pq" / f"{kind.name}.parquet")
        assert table.num_rows == counts[kind.name] == parquet["files"][kind.name]["rows"]
        assert table.schema.names == [c.name for c in kind.columns]
        assert set(table.column("schema_version").to_pylist()) == {SCHEMA_VERSION}
        lines = (tmp_path / "jl" / f"{kind.name}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        assert len(rows) == counts[kind.name] == jsonl["files"][kind.name]["rows"]
        assert all(list(r) == [c.name for c in kind.columns] for r in rows)
    # Same rows in both formats, and the findings carry what the reads found.
    events = pq.read_table(tmp_path / "pq" / "events.parquet").column("hash").to_pylist()
    assert events == [json.loads(x)["hash"] for x in (tmp_path / "jl" / "events.jsonl").read_text().splitlines()]
    findings = [json.loads(x) for x in (tmp_path / "jl" / "findings.jsonl").read_text().splitlines()]
    assert {f["finding"] for f in findings if f["event"] == "verification_finished"} == {"expected"}
    # Bounds: nothing settled before the epoch, everything before the far future.
    none = copy.ok("ledger", "export", "--out", str(tmp_path / "none"), "--until", "2000-01-01")
    assert all(f["rows"] == 0 for f in none["files"].values())
    assert pq.read_table(tmp_path / "pq" / "actions.parquet").schema.metadata[
        b"proofline.export.schema_version"] == str(SCHEMA_VERSION).encode()


def test_the_export_reference_page_lists_the_schema():
    page = (ROOT / "docs" / "reference" / "export.md").read_text()
    assert schema_markdown() in page and f"Schema version: **{SCHEMA_VERSION}**" in page


def test_request_ids_are_recorded_on_calls_and_reads(copy: Copy):
    calls = copy.sql("SELECT action_id, actor, evidence FROM ledger_events WHERE event = 'tool_called' "
                     "AND action_id = ANY(%s) ORDER BY id", (copy.source.actions,))
    assert len(calls) == len(copy.source.actions)
    seen: dict[str, list[int]] = {}
    for row in calls:
        ev = row["evidence"]
        assert isinstance(ev["mcp_connection"], str) and isinstance(ev["mcp_request_id"], int), ev
        seen.setdefault(ev["mcp_connection"], []).append(ev["mcp_request_id"])
    for ids in seen.values():
        assert len(ids) == len(set(ids)) and ids == sorted(ids), [  # a per-connection counter, rising
            (r["actor"], r["evidence"]) for r in calls]
    reads = copy.sql("SELECT evidence FROM ledger_events WHERE event = 'verification_finished' "
                     "AND action_id = ANY(%s)", (copy.source.actions,))
    assert len(reads) == len(copy.source.actions)
    read_ids: dict[str, list[int]] = {}
    for row in reads:
        ev = row["evidence"]
        assert ev["mcp_connection"] not in seen  # reads go through the read identity's own session
        assert ev["mcp_request_ids"] and all(isinstance(i, int) for i in ev["mcp_request_ids"]), ev
        assert all("mcp_request_id" in t for t in ev["timeline"])
        read_ids.setdefault(ev["mcp_connection"], []).extend(ev["mcp_request_ids"])
    for ids in read_ids.values():
        assert len(ids) == len(set(ids))
    # The target read before the call: its request is on the preconditions' evidence.
    passed = copy.sql("SELECT evidence FROM ledger_events WHERE event = 'preconditions_passed' "
                      "AND action_id = ANY(%s)", (copy.source.actions,))
    assert len(passed) == len(copy.source.actions)
    for row in passed:
        read = row["evidence"]["target_read"]
        assert read["mcp_connection"] in seen and isinstance(read["mcp_request_id"], int), row
        assert read["mcp_request_id"] not in seen[read["mcp_connection"]]  # not the call's id
