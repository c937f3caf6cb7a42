"""Runs the how-to "Configuring a server you did not write" (docs/how-to/third-party-servers.md) as written, against the
reference SQLite MCP server installed from PyPI into its own virtual environment, and checks that
the action it publishes was verified through that server's read-only identity."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.settings import ROOT
from proofline_kit.processes import stop_group
from tests.conftest import build_stack, teardown_stack
from tests.integration.doc_blocks import as_script, blocks

GUIDE = ROOT / "docs" / "how-to" / "third-party-servers.md"
# The guide gets 600 s, the registry probe 180 and the stderr probe 120: the suite's default of 180 s
# for the whole test ended it on a slow day (a timeout here ends a hang, it measures nothing).
pytestmark = pytest.mark.timeout(1200)


def chapter_blocks() -> list[tuple[str, str]]:
    """Every fenced block of the guide's page, in order."""
    return blocks(GUIDE)


def registry_reachable(tmp: Path) -> str | None:
    """None when PyPI answers for the package, else why not."""
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(tmp),
                            "mcp-server-sqlite"], capture_output=True, text=True, timeout=180)
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["no output"])[-1]


def test_the_third_party_chapter_runs_as_written(tmp_path: Path) -> None:
    blocks = chapter_blocks()
    assert {lang for lang, _ in blocks} >= {"bash", "yaml", "python"}
    unreachable = registry_reachable(tmp_path / "probe")
    # The suite's own install needs the registry too: unreachable is a failure with its cause, never a skip.
    assert not unreachable, f"the package registry is unreachable, so mcp-server-sqlite cannot be installed: {unreachable}"
    stack = build_stack("stdio", tmp_path / "stack")
    guide = tmp_path / "guide"
    guide.mkdir()
    env = {k: v for k, v in stack.env.items() if k not in ("PROOFLINE_SERVERS_FILE", "PROOFLINE_CONTRACTS_DIR")}
    env["PATH"] = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    proc = subprocess.Popen(["bash", "-c", as_script(blocks)], cwd=guide, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
        log = (guide / "worker.log").read_text() if (guide / "worker.log").exists() else ""
        assert proc.returncode == 0, f"{err[-3000:]}\n--- worker.log ---\n{log[-3000:]}"
        action_id, status, outcome, reason = out.strip().splitlines()[-1].split()
        assert (status, outcome, reason) == ("closed", "completed_verified", "verified")
        row = stack.action(action_id)
        assert (row.status, row.outcome, row.tool, row.envelope["server"]["name"]) == (
            ActionStatus.closed, Outcome.completed_verified, "write_query", "shop")
        events = {e["event"]: e["evidence"] for e in stack.timeline(action_id)}
        assert events["preconditions_passed"]["before"] == {"tenant": "acme", "status": "paid"}
        # The effect, read from the server's own database file, happened once.
        with sqlite3.connect(guide / "data" / "shop.db") as db:
            assert db.execute("SELECT status FROM orders WHERE id = 42").fetchone() == ("shipped",)
        assert "validation errors for ClientRequest" not in log  # protocol: legacy, as the chapter says
    finally:
        stop_group(proc.pid)
        teardown_stack(stack)
    # Without `protocol: legacy`, the flood the chapter describes is one warning per server identity.
    auto = guide / "servers-auto.yaml"
    auto.write_text((guide / "servers.yaml").read_text().replace("protocol: legacy", "protocol: auto"))
    probe = textwrap.dedent("""
        import time
        from proofline.controller import describe_server
        from proofline.settings import get_settings
        from worker.server_stderr import suppressed
        for _ in range(3):
            describe_server(get_settings(), "shop")
        # The stderr readers count on their own threads: wait until all three blocks are in.
        deadline = time.monotonic() + 60
        while suppressed("shop", "write")[0] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        print(*suppressed("shop", "write"))
    """)
    ran = subprocess.run([sys.executable, "-c", probe], cwd=guide, capture_output=True, text=True, timeout=120,
                         env={**env, "SHOP_DATA": str(guide / "data"), "PROOFLINE_SERVERS_FILE": str(auto)})
    assert ran.returncode == 0, ran.stderr
    connections, lines = map(int, ran.stdout.split())
    assert connections == 3 and lines >= 3 * 30  # each connection's block of validation errors was counted
    assert ran.stderr.count("is on an older MCP SDK") == 1 and "protocol: legacy" in ran.stderr
    assert "validation error" not in ran.stderr.replace("validation errors for the current", "")
