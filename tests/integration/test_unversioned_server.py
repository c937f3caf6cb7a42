"""A server built on the 2.x SDK's ``MCPServer`` without a version reports an empty version string.
Proofline records that as the declared value ``NO_VERSION`` on both sides (pin and envelope, worker
and ledger), so its actions run. They used to end ``not_started / server_version_changed``: the
envelope said "unknown", the worker compared it with "".

The server is the kit's system of record, a real ``MCPServer``, started with ``SOR_VERSION=""``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from ledger.states import ActionStatus, Outcome
from proofline.envelope import NO_VERSION
from proofline_kit import zygote
from tests.conftest import build_stack, start_workers, teardown_stack
from tests.integration.cli_run import environment

pytestmark = pytest.mark.timeout(300)


def test_an_unversioned_server_runs_its_actions_and_the_ledger_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOR_VERSION", "")  # what this process (the controller) starts the server with
    stack = build_stack("stdio", tmp_path, extra_env={"SOR_VERSION": ""})
    try:
        servers = yaml.safe_load(stack.servers_file.read_text())
        servers["servers"]["sor"].pop("expected_version")  # the servers file cannot expect a version
        stack.servers_file.write_text(yaml.safe_dump(servers))

        version, _ = stack.live()
        assert version == NO_VERSION
        pins = tmp_path / "pins.json"
        env = environment(stack, {"PROOFLINE_PINS_FILE": str(pins), "SOR_VERSION": ""})
        pinned = zygote.run([sys.executable, "-m", "proofline", "contracts", "pin"], env=env,
                                capture_output=True, text=True, timeout=120)
        assert pinned.returncode == 0, pinned.stderr
        assert json.loads(pins.read_text())["servers"]["sor"]["version"] == NO_VERSION
        checked = zygote.run([sys.executable, "-m", "proofline", "contracts", "pin", "--check"], env=env,
                                 capture_output=True, text=True, timeout=120)
        assert checked.returncode == 0 and f"ok  sor {NO_VERSION}" in checked.stdout, checked.stderr

        start_workers(stack, beat=False)
        envelope = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": "unversioned", "owner": "ops"},
                                  target={"type": "ticket_queue", "id": "acme-ops"})
        assert envelope.server.version == NO_VERSION
        stack.publish(envelope)
        row = stack.wait_settled(envelope.action_id, timeout=60)
        assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row
        recorded = [e["evidence"] for e in stack.timeline(envelope.action_id) if "server_version" in (e["evidence"] or {})]
        assert recorded and {e["server_version"] for e in recorded} == {NO_VERSION}, stack.timeline(envelope.action_id)
    finally:
        teardown_stack(stack)
