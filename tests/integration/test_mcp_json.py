"""``proofline servers import``: the ``mcpServers`` JSON every MCP client reads, as servers-file
entries (worker/mcp_json.py): stdio servers sandboxed, secret variables and headers kept out of the
servers file, a review list of what was inferred; a servers file may also name such a file
directly. The last test drives a verified action through a real worker from an imported file."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ledger.states import Outcome
from proofline.errors import ConfigurationError
from proofline.settings import ROOT
from proofline_kit import zygote
from tests.conftest import build_stack, start_workers, teardown_stack
from tests.helpers import ticket_env
from worker.servers import load_servers


def proofline(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, "-m", "proofline", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd)


def client_file(folder: Path, servers: dict) -> Path:
    path = folder / "claude_desktop_config.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


def test_an_import_sandboxes_stdio_servers_and_keeps_secrets_out(tmp_path: Path) -> None:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    source = client_file(tmp_path, {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", str(workspace)],
                  "env": {"GITHUB_TOKEN": "ghp_do_not_copy", "LOG_LEVEL": "debug"}},
        "crm": {"type": "http", "url": "https://crm.example.test/mcp", "headers": {"Authorization": "Bearer s3cr3t"}},
        "off": {"command": "x", "disabled": True},
    })
    out = tmp_path / "servers.yaml"
    done = proofline("--json", "servers", "import", str(source), "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    written = yaml.safe_load(out.read_text())["servers"]
    files, crm = written["files"], written["crm"]
    assert set(written) == {"files", "crm"}
    assert files["transport"] == "stdio" and "sandbox" in files and files["sandbox"].get("network") is not True
    assert files["sandbox"]["ro_paths"] == [str(workspace)] and files["read_identity"]["sandbox"]["uid"] == 65533
    assert files["env"] == {"LOG_LEVEL": "debug"} and files["env_allow"] == ["GITHUB_TOKEN"]
    secret = Path(crm["headers_from_files"]["Authorization"])
    assert secret.read_text() == "Bearer s3cr3t" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    # No secret value is in the servers file, and each inference is named for review.
    assert "ghp_do_not_copy" not in out.read_text() and "s3cr3t" not in out.read_text()
    review = "\n".join(report["review"])
    for expected in ("GITHUB_TOKEN looks like a secret", "npx downloads its package", str(workspace),
                     "off: disabled", "crm: the read identity"):
        assert expected in review
    load_servers.cache_clear()
    assert set(load_servers(out)) == {"files", "crm"}  # what was written is a valid servers file
    # A second import of the same names is refused unless asked to replace them.
    again = proofline("servers", "import", str(source), "--out", str(out))
    assert again.returncode == 1 and "already in" in again.stderr


def test_a_servers_file_may_name_a_client_file_and_its_own_entries_win(tmp_path: Path) -> None:
    source = client_file(tmp_path, {"tools": {"command": "/usr/bin/env", "args": ["true"]},
                                    "mine": {"command": "/usr/bin/env", "args": ["false"]}})
    servers = tmp_path / "servers.yaml"
    servers.write_text(yaml.safe_dump({"import_mcp_json": [source.name], "servers": {"mine": {
        "transport": "stdio", "command": ["/usr/bin/env", "mine"], "read_identity": {}}}}))
    load_servers.cache_clear()
    loaded = load_servers(servers)
    assert loaded["tools"].write.command == ("/usr/bin/env", "true") and loaded["tools"].write.sandbox.enabled
    assert loaded["mine"].write.command == ("/usr/bin/env", "mine")
    # Headers are credentials: a client file read as it is may not carry them.
    client_file(tmp_path, {"remote": {"url": "http://127.0.0.1:9/mcp", "headers": {"X-Key": "k"}}})
    load_servers.cache_clear()
    with pytest.raises(ConfigurationError, match="headers carry credentials"):
        load_servers(servers)
    source.write_text("{not json")
    load_servers.cache_clear()
    with pytest.raises(ConfigurationError, match="line 1, column 2: not valid JSON"):
        load_servers(servers)


def test_an_imported_client_file_drives_a_verified_action(tmp_path: Path) -> None:
    s = build_stack("stdio", tmp_path / "stack")
    try:
        python = [sys.executable, "-m"]
        source = client_file(s.workdir, {
            "sor": {"command": python[0], "args": [python[1], "proofline_kit.sor", "--transport", "stdio"],
                    "env": {"SOR_DB": str(s.sor_db), "SOR_ROLE": "writer", "PYTHONPATH": str(ROOT)}},
            "audit": {"command": python[0], "args": [python[1], "proofline_kit.audit", "serve", "--transport", "stdio"],
                      "env": {"AUDIT_DB": str(s.audit_db), "PYTHONPATH": str(ROOT)}},
        })
        out = s.workdir / "imported.yaml"
        done = proofline("servers", "import", str(source), "--out", str(out), env=s.env)
        assert done.returncode == 0, done.stderr
        var = str(s.sor_db.parent)
        assert f"review  sor: {var}" in done.stdout  # the database folder was found and is to be reviewed
        # What the review asks for: the writer writes its database folder.
        doc = yaml.safe_load(out.read_text())
        doc["servers"]["sor"]["sandbox"] = {"rw_paths": [var]}
        out.write_text(yaml.safe_dump(doc))
        s.env["PROOFLINE_SERVERS_FILE"] = str(out)
        s.settings = s.settings.model_copy(update={"servers_file": str(out)})
        start_workers(s)
        env = ticket_env(s)
        s.publish(env)
        row = s.wait_settled(env.action_id, timeout=60)
        assert row.outcome == Outcome.completed_verified, row.reason_code
        assert s.effects(env.idempotency_key) == 1
    finally:
        teardown_stack(s)
