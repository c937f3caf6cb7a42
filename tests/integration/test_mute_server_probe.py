"""A server that starts and never answers does not hold ``contracts pin`` (or any probe of the
controller's) forever: it is refused as ``mcp_unavailable`` within twice the connect limit, naming
the setting, and the server is stopped."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

from proofline.controller import describe_server
from proofline.errors import McpUnavailable
from proofline.settings import Settings
from proofline_kit.processes import gone, wait_for
from worker.servers import load_servers


def mute_processes(marker: str) -> list[psutil.Process]:
    """The live processes whose command line holds ``marker`` (a zombie has stopped already)."""
    return [p for p in psutil.process_iter(["cmdline"])
            if marker in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid() and not gone(p)]


def test_a_server_that_never_answers_is_refused_in_time_and_stopped(tmp_path: Path) -> None:
    marker = f"mute-{uuid.uuid4().hex[:8]}"
    (tmp_path / "var").mkdir()
    servers = tmp_path / "servers.yaml"
    servers.write_text(yaml.safe_dump({"servers": {"mute": {
        "transport": "stdio", "cwd": "var",
        # Starts, reads nothing, answers nothing.
        "command": ["{python}", "-c", f"import time; time.sleep(600)  # {marker}"],
        "sandbox": {"rw_paths": ["var"]},
        "read_identity": {"sandbox": {"uid": 65533}},
    }}}))
    load_servers.cache_clear()
    settings = Settings(servers_file=servers, environment="development", mcp_connect_timeout_seconds=1.5)
    started = time.monotonic()
    with pytest.raises(McpUnavailable, match=r"mute/write: no tool list within 3s \(twice PROOFLINE_MCP_CONNECT_TIMEOUT"):
        describe_server(settings, "mute")
    # Refused at the limit, not after the server's own 600 s (a generous bound: the machine is shared).
    assert time.monotonic() - started < 60
    wait_for(lambda: not mute_processes(marker), 30, what="the mute server to be stopped")
