"""Every how-to guide runs as written: its shell, Python and SQL blocks, in order, as one bash
script in a folder of its own, with a running stack's settings (Postgres, Redis, a worker with
beat, the demo's system of record). A block a guide cannot run here carries a visible note above
it ("Not run by the test suite: <why>"), and those stay few. The third-party guide has its own
test (tests/integration/test_third_party_guide.py), the tutorial pages theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.settings import ROOT
from proofline_kit import zygote
from proofline_kit.sor import store as sor
from tests.conftest import Stack
from tests.integration.doc_blocks import guide_blocks, guide_script

pytestmark = pytest.mark.timeout(600)

GUIDES = ROOT / "docs" / "how-to"
#: Tested elsewhere, with a server installed from PyPI.
OWN_TEST = {"third-party-servers.md"}
#: The blocks the guides may leave unrun, at most (each with its reason in the page).
MOST_NOT_RUN = 3


def run_guide(stack: Stack, name: str, tmp: Path, **env: str) -> str:
    blocks, _ = guide_blocks(GUIDES / name)
    assert blocks, f"{name} has no block to run"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "SOR_"))}
    base.update({k: v for k, v in stack.env.items() if k.startswith(("PROOFLINE_", "SOR_"))})
    base.update(PATH=f"{Path(sys.executable).parent}:{base.get('PATH', '/usr/bin:/bin')}", PYTHONPATH=str(ROOT), **env)
    folder = tmp / name.removesuffix(".md")
    folder.mkdir()
    done = subprocess.run(["bash", "-c", guide_script(blocks)], cwd=folder, env=base, capture_output=True, text=True,
                          timeout=500)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-3000:]}"
    return done.stdout


def test_every_guide_is_run_and_few_blocks_are_not() -> None:
    pages = sorted(p.name for p in GUIDES.glob("*.md"))
    assert {p for p in pages if p not in OWN_TEST} == GUIDE_TESTS, pages  # a new guide needs its test here
    not_run = {p: guide_blocks(GUIDES / p)[1] for p in pages}
    assert sum(len(v) for v in not_run.values()) <= MOST_NOT_RUN, not_run


def test_controller_sdk_guide(stack: Stack, tmp_path: Path) -> None:
    out = run_guide(stack, "controller-sdk.md", tmp_path).strip().splitlines()
    action_id, status, outcome, verified = out[-2].split()
    assert (status, outcome, verified) == ("closed", "completed_verified", "True"), out
    assert stack.action(action_id).outcome == Outcome.completed_verified
    assert out[-1].count("completed_verified") == 3, out[-1]  # the batch


def test_upgrades_guide(stack: Stack, tmp_path: Path) -> None:
    out = run_guide(stack, "upgrades.md", tmp_path)
    assert "migrations  at head" in out and "FAIL" not in out, out


def test_backup_restore_guide(stack: Stack, tmp_path: Path) -> None:
    out = run_guide(stack, "backup-restore.md", tmp_path)
    assert "FAIL" not in out, out


def test_key_rotation_guide(stack: Stack, tmp_path: Path) -> None:
    """On a keys folder of its own: the stack's keys keep signing for the other guides."""
    keys = tmp_path / "keys"
    made = zygote.run([sys.executable, "-m", "proofline", "keys", "generate", "--dir", str(keys)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    out = run_guide(stack, "key-rotation.md", tmp_path, PROOFLINE_KEYS_DIR=str(keys))
    ring = json.loads((keys / "keyring.json").read_text())["keys"]
    controllers = [k for k in ring if k["role"] == "controller"]
    assert len(controllers) == 2 and sum(k["revoked"] for k in controllers) == 1, (controllers, out)
    assert [k for k in controllers if not k["revoked"]][0]["not_after"] is None  # the new one signs


def test_incident_response_guide(stack: Stack, tmp_path: Path) -> None:
    """ACTION is an escalated action: its verification read path was down."""
    tenant = f"t{uuid.uuid4().hex[:8]}"
    sor.set_read_outage(stack.sor_db, True, role="reader")
    try:
        envelope = stack.envelope("ticket.create", tenant="acme", target={"type": "ticket_queue", "id": "acme-ops"},
                                  arguments={"tenant": "acme", "title": f"incident {tenant}", "owner": "ops"})
        stack.publish(envelope)
        row = stack.wait_settled(envelope.action_id, timeout=120)
    finally:
        sor.set_read_outage(stack.sor_db, False, role="reader")
    assert row.status == ActionStatus.escalated, row
    out = run_guide(stack, "incident-response.md", tmp_path, ACTION=envelope.action_id)
    assert f"{envelope.action_id} resolved as no_effect" in out, out
    assert stack.action(envelope.action_id).status == ActionStatus.closed
    assert "1. Authorized" in out  # forensics told the story


def test_console_guide(stack: Stack, tmp_path: Path) -> None:
    users = tmp_path / "users.json"
    out = run_guide(stack, "console.md", tmp_path, PROOFLINE_CONSOLE_USERS_FILE=str(users))
    assert "alice" in users.read_text() and "token" in out.lower(), out


def test_scaling_out_guide(stack: Stack, tmp_path: Path) -> None:
    out = run_guide(stack, "scaling-out.md", tmp_path)
    assert "holder" in out or out.strip() == "" or "pid" in out, out


def test_rabbitmq_guide(stack: Stack, tmp_path: Path) -> None:
    """On this machine's RabbitMQ, with a virtual host and user the test removes afterwards."""
    try:
        out = run_guide(stack, "rabbitmq.md", tmp_path, RABBITMQ_PASSWORD=f"pw-{uuid.uuid4().hex}")
    finally:
        for argv in (["delete_vhost", "proofline"], ["delete_user", "proofline"]):
            subprocess.run(["rabbitmqctl", *argv], capture_output=True, timeout=120)
    assert "ok    broker      reachable at amqp://proofline:**@127.0.0.1:5672/proofline" in out, out


def test_retention_and_export_guide(stack: Stack, tmp_path: Path) -> None:
    """ACTION is a verified action; the pruner role's URL is the stack database's."""
    from proofline_kit.resources import with_database

    envelope = stack.envelope("ticket.create", tenant="acme", target={"type": "ticket_queue", "id": "acme-ops"},
                              arguments={"tenant": "acme", "title": f"kept {uuid.uuid4().hex[:8]}", "owner": "ops"})
    stack.publish(envelope)
    assert stack.wait_settled(envelope.action_id).outcome == Outcome.completed_verified
    name = stack.admin_url.rsplit("/", 1)[1]
    out = run_guide(stack, "retention-and-export.md", tmp_path, ACTION=envelope.action_id,
                    PROOFLINE_PRUNER_DATABASE_URL=with_database(stack.admin_url, name, user="proofline_pruner"))
    assert '"actions"' in out, out  # the manifest's counts
    folder = tmp_path / "retention-and-export"
    assert {p.name for p in (folder / "export").iterdir()} >= {"actions.parquet", "events.parquet", "manifest.json"}
    held = [e for e in stack.timeline(envelope.action_id) if e["event"] == "retention_set"]
    assert [e["evidence"].get("retention_class") for e in held][-1:] == ["standard"], held


GUIDE_TESTS = {"controller-sdk.md", "upgrades.md", "backup-restore.md", "key-rotation.md", "incident-response.md",
               "console.md", "scaling-out.md", "rabbitmq.md", "retention-and-export.md", "oauth-servers.md"}


def test_oauth_servers_guide(stack: Stack, tmp_path: Path) -> None:
    out = run_guide(stack, "oauth-servers.md", tmp_path)
    assert "without a token: 401" in out and '"scopes_supported":["sor:write"]' in out, out
    assert "create_ticket among its tools: True" in out, out  # reached with the writer's token
    assert "received the authorization" in out and "stored the refresh token for sor (write)" in out, out
    assert "600 state/secrets/oauth-sor-write.refresh" in out, out
    # Per-action tokens: the grant is advertised, the block loads, a scope wider than the identity's is refused.
    assert "token exchange advertised: True" in out and '"scope": "sor:write"' in out, out
    assert "a wider per-action scope is refused: True" in out, out
    for secret in ("guide-writer-secret-1", "guide-reader-secret-2"):
        assert secret not in out
