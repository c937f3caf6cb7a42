"""The operator's command line against a running stack: publish, status, verify-ledger, run,
kill switches, manual queue, reconcile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from ledger.states import Outcome
from proofline.settings import ROOT
from tests.conftest import Stack


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")}
    env.update({k: v for k, v in stack.env.items() if k.startswith(("PROOFLINE_", "SOR_"))})
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "proofline", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_publish_status_and_ledger_check_from_the_command_line(stack: Stack) -> None:
    action_id = f"cli-{time.monotonic_ns()}"
    out = cli(stack, "--json", "publish", "--action-type", "ticket.create", "--tenant", "acme",
              "--target", json.dumps({"type": "ticket_queue", "id": "acme-ops"}),
              "--args", json.dumps({"tenant": "acme", "title": "from the cli", "owner": "ops"}),
              "--run-id", f"run-{action_id}", "--action-id", action_id)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["action_id"] == action_id
    row = stack.wait_settled(action_id)
    assert row.outcome == Outcome.completed_verified
    assert stack.effects(row.idempotency_key) == 1
    status = cli(stack, "status", action_id)
    assert status.returncode == 0, status.stderr
    assert "completed_verified" in status.stdout and "published" in status.stdout and "tool_called" in status.stdout
    as_json = json.loads(cli(stack, "status", action_id, "--json").stdout)
    assert as_json["outcome"] == "completed_verified" and as_json["timeline"][0]["event"] == "published"
    check = cli(stack, "verify-ledger")
    assert check.returncode == 0 and "every chain verifies" in check.stdout


def test_kill_switch_and_reconcile_from_the_command_line(stack: Stack) -> None:
    value = f"tenant-{time.monotonic_ns()}"
    assert "set" in cli(stack, "kill", "set", "--scope", "tenant", "--value", value, "--any-tenant", "--by", "ops",
                        "--why", "drill").stdout
    listed = cli(stack, "kill", "list").stdout
    assert value in listed and "drill" in listed
    assert "cleared" in cli(stack, "kill", "clear", "--scope", "tenant", "--value", value, "--by", "ops",
                            "--why", "drill over").stdout
    assert value not in cli(stack, "kill", "list").stdout
    sweep = cli(stack, "--json", "reconcile")
    assert sweep.returncode == 0, sweep.stderr
    assert set(json.loads(sweep.stdout)) >= {"not_started", "lease_expired", "verification_stalled"}
    assert cli(stack, "manual", "list", "--json").returncode == 0
