"""Runs the tutorial as written, in an empty folder, against the machine's Postgres and a claimed
Redis database, with the checkout's ``proofline`` on PATH:

- "Your own Postgres and broker" (docs/tutorial/own-services.md): every block marked
  ``<!-- tutorial-test -->``, in order;
- "Your first contract" (docs/tutorial/first-contract.md): after the first three steps of the page
  before it (database, keys, roles), every block: the server and files it names are saved, the
  commands run.

Then each checks from the ledger itself what the actions it published ended as."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from proofline.settings import ROOT
from proofline_kit.processes import stop_group
from proofline_kit.resources import ADMIN_URL, claim_redis_db, drop_database, release_redis_db, with_database
from tests.integration.doc_blocks import as_script, blocks

OWN_SERVICES = ROOT / "docs" / "tutorial" / "own-services.md"
FIRST_CONTRACT = ROOT / "docs" / "tutorial" / "first-contract.md"

pytestmark = pytest.mark.timeout(420)


def marked_blocks() -> list[str]:
    return [body for lang, body in blocks(OWN_SERVICES, marked_only=True) if lang == "bash"]


def run_in_empty_folder(script: str, folder: Path, extra_env: dict[str, str]) -> tuple[subprocess.Popen, str, str]:
    """Run ``script`` with bash in ``folder`` (its own session, so what it leaves running can be
    stopped by its group), with the checkout's interpreter first on PATH and no Proofline setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "SOR_", "VIRTUAL_ENV"))}
    env.update(PATH=f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", **extra_env)
    proc = subprocess.Popen(["bash", "-c", script], cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=360)
    finally:
        stop_group(proc.pid)  # what the page left running (worker, beat): its checks read the ledger
    return proc, out, err


@pytest.fixture
def services() -> Iterator[tuple[str, str, str]]:
    """A database name nobody uses (the page creates it), its admin URL, and a claimed Redis URL."""
    name = f"pl_tutorial_{uuid.uuid4().hex[:10]}"
    admin = with_database(ADMIN_URL, name)
    claim = claim_redis_db()
    try:
        yield name, admin, claim.url
    finally:
        release_redis_db(claim)
        drop_database(admin)


def action_rows(admin: str, *action_ids: str) -> dict[str, tuple[str, str, str]]:
    with psycopg.connect(admin) as conn:
        rows = conn.execute("SELECT action_id, status, outcome, reason_code FROM actions WHERE action_id = ANY(%s)",
                            [list(action_ids)]).fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


def test_the_page_marks_every_step() -> None:
    marked = marked_blocks()
    assert len(marked) == 6
    script = "\n".join(marked)
    for step in ("proofline migrate", "proofline keys generate", "proofline worker", "proofline beat",
                 "proofline publish", "proofline doctor"):
        assert step in script, step


def test_the_own_services_tutorial_runs_as_written(tmp_path: Path, services: tuple[str, str, str]) -> None:
    name, admin, broker = services
    proc, out, err = run_in_empty_folder("set -euo pipefail\n" + "\n".join(marked_blocks()), tmp_path,
                                         {"DB": name, "BROKER": broker})
    log = (tmp_path / "worker.log").read_text(errors="replace") if (tmp_path / "worker.log").exists() else ""
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}\n--- worker.log ---\n{log[-3000:]}"
    # doctor printed one line per check, every one ok (it exits 1 otherwise, failing the script)
    checks = [line.split()[1] for line in out.splitlines() if re.match(r"^(ok|FAIL) ", line)]
    assert set(checks) >= {"database", "migrations", "broker", "reconciler", "keys", "contracts", "servers"}
    assert "ledger chain intact" in out, out[-2000:]
    assert action_rows(admin, "first-ticket") == {"first-ticket": ("closed", "completed_verified", "verified")}
    with psycopg.connect(admin) as conn:
        events = [e for (e,) in conn.execute("SELECT event FROM ledger_events WHERE action_id = 'first-ticket' "
                                             "ORDER BY seq")]
    assert events[0] == "published" and "tool_called" in events and "verification_finished" in events
    assert events[-1] == "final_state"


def test_the_first_contract_tutorial_runs_as_written(tmp_path: Path, services: tuple[str, str, str]) -> None:
    name, admin, broker = services
    page = blocks(FIRST_CONTRACT)
    assert {lang for lang, _ in page} == {"python", "yaml", "bash"}
    script = "\n".join(marked_blocks()[:3]) + "\n" + as_script(page)
    proc, out, err = run_in_empty_folder("set -euo pipefail\n" + script, tmp_path, {"DB": name, "BROKER": broker})
    log = (tmp_path / "worker.log").read_text(errors="replace") if (tmp_path / "worker.log").exists() else ""
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}\n--- worker.log ---\n{log[-3000:]}"
    assert action_rows(admin, "first-note", "second-note") == {
        "first-note": ("closed", "completed_verified", "verified"),
        "second-note": ("closed", "not_started", "stale_version")}
    # The note the server keeps, read from its own file: written once, by the first action only.
    assert json.loads((tmp_path / "data" / "notes.json").read_text()) == {"greeting": {"text": "hello", "version": 1}}
