"""Reads that lag the write: verification's read-only identity reads a replica of the system of
record that the test advances itself, so a read is stale for exactly as long as the test says.

The replica is a copy of the writer's SQLite file taken with SQLite's backup API and put in place
with an atomic rename; the read identity's ``SOR_DB`` names it. It is advanced only once the
witness shows verification has read it stale (a condition, not a timing margin).

- Within the contract's declared consistency delay, a stale "absent" is tolerated: verification
  keeps reading, the replica catches up, and the refund is verified; it is called once.
- Past the declared delay, the stale read is taken as proof of absence and the same envelope is
  retried; the retry's own fresh read of the target (through the write identity) sees the account
  changed, so nothing is called again; the caught-up replica then proves the refund. One refund.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import yaml

from ledger.states import ActionStatus, Outcome
from proofline.settings import ROOT
from tests.conftest import Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import new_account, refund_env

READ_TOOL = "find_refund_by_key"


def contracts_with_delay(directory: Path, seconds: float) -> Path:
    """The project's contracts, with ``refund.issue`` declaring a consistency delay and reading the
    system of record alone: these tests are about one lagging read path (with the audit source, a
    stale "absent" the audit log contradicts is an evidence_conflict: tests/faults/
    test_independent_evidence.py)."""
    shutil.copytree(ROOT / "contracts", directory)
    path = directory / "refund.issue.yaml"
    spec = yaml.safe_load(path.read_text())
    spec["verification"]["consistency_delay_seconds"] = seconds
    spec["verification"].pop("sources")
    spec["verification"].pop("evidence")
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return directory


def advance(primary: Path, replica: Path) -> None:
    """Copy the writer's committed state to the replica in one atomic step."""
    staging = replica.with_name(replica.name + ".next")
    staging.unlink(missing_ok=True)
    src, dst = sqlite3.connect(primary), sqlite3.connect(staging)
    try:
        src.backup(dst)
        dst.execute("PRAGMA journal_mode=DELETE")  # a read-only mount cannot open a WAL database's -shm
    finally:
        src.close()
        dst.close()
    os.chmod(staging, 0o644)  # the sandboxed reader runs under another uid
    os.replace(staging, replica)


def lagging_stack(tmp: Path, delay: float) -> tuple[Stack, Path]:
    s = build_stack("stdio", tmp, extra_env={"PROOFLINE_CONTRACTS_DIR": str(contracts_with_delay(tmp / "contracts",
                                                                                                  delay))})
    replica = s.sor_db.with_name("replica.sqlite3")
    advance(s.sor_db, replica)
    spec = yaml.safe_load(s.servers_file.read_text())
    spec["servers"]["sor"]["read_identity"].setdefault("env", {})["SOR_DB"] = str(replica)
    s.servers_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    start_workers(s)
    return s, replica


def stale_reads(s: Stack, since: int) -> int:
    return s.witness.count(tool=READ_TOOL, server="sor:read", since=since)


def findings(s: Stack, action_id: str) -> list[str]:
    return [e["evidence"]["finding"] for e in s.timeline(action_id) if e["event"] == "verification_finished"]


def test_lag_within_the_declared_delay_is_waited_out(tmp_path) -> None:
    s, replica = lagging_stack(tmp_path, delay=8.0)
    try:
        env = refund_env(s, new_account(s))
        start = s.witness.mark()
        s.publish(env)
        wait_for(lambda: s.effects(env.idempotency_key) == 1 and stale_reads(s, start) >= 2, 30,
                 what="verification to read the stale replica twice")
        assert s.action(env.action_id).status == ActionStatus.verifying  # a stale absence proved nothing
        advance(s.sor_db, replica)
        row = s.wait_settled(env.action_id)
        assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
        assert findings(s, env.action_id) == ["expected"]
        assert s.events(env.action_id).count("tool_called") == 1
        assert s.witness.count(key=env.idempotency_key) == 1
        assert s.effects(env.idempotency_key) == 1
    finally:
        teardown_stack(s)


def test_lag_past_the_declared_delay_does_not_pay_twice(tmp_path) -> None:
    s, replica = lagging_stack(tmp_path, delay=3.0)
    try:
        env = refund_env(s, new_account(s))
        s.publish(env)
        # The replica stays behind until the retry has been refused by the target's fresh read.
        wait_for(lambda: any(e["event"] == "preconditions_failed" and e["evidence"].get("on") == "retry"
                             for e in s.timeline(env.action_id)), 60, what="the retry to be stopped by its read")
        advance(s.sor_db, replica)
        row = s.wait_settled(env.action_id, timeout=60)
        assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
        assert findings(s, env.action_id) == ["absent", "expected"]
        assert s.events(env.action_id).count("tool_called") == 1
        assert s.witness.count(key=env.idempotency_key) == 1
        assert s.effects(env.idempotency_key) == 1
    finally:
        teardown_stack(s)
