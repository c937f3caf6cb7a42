"""Putting a witness in front of every server of a servers file.

stdio: the relay runs *inside* the server's sandbox, as the command bwrap starts, with the server as
its child. The worker's pipe then ends at the relay, which sees every byte the server reads and
writes; the sandbox confines the relay exactly as it confines the server (no network, the same
uid, rlimits); bwrap's exit status, which the worker reads for sandbox violations, is the relay's,
and the relay exits the way its server did (same code, or the same signal). The one path the
sandbox gains is the witness directory, bound read-write so the relay can append to its log.
Running it outside instead would need the worker to start it (the worker builds the bwrap command
line itself), i.e. test code inside the runtime.

http: the relay is its own process on loopback between the workers (or the fault proxy) and the
server; the servers file names the relay's port, which the relay binds itself (port 0) and reports.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

#: The name a server's read identity is recorded under (its write identity keeps the bare name).
READ_SUFFIX = ":read"


def relay_command(command: list[str], log: Path, name: str) -> list[str]:
    """``command`` (a servers-file stdio argv) run behind the stdio relay."""
    return ["{python}", "-m", "proofline_kit.witness", "stdio", "--log", str(log), "--name", name, "--", *command]


def witness_stdio_servers(text: str, log: Path) -> str:
    """A servers file (YAML text) with every stdio identity behind a relay that logs to ``log``.

    The write identity is recorded as the server's name, the read identity as ``name:read``; each
    gets the log's directory as a read-write path of its sandbox and nothing else more."""
    raw: dict[str, Any] = yaml.safe_load(text) or {}
    out = copy.deepcopy(raw)
    for name, spec in (out.get("servers") or {}).items():
        if spec.get("transport", "stdio") != "stdio":
            continue
        command = list(spec["command"])
        spec["command"] = relay_command(command, log, name)
        _grant(spec, log.parent)
        read = spec.setdefault("read_identity", {})
        read["command"] = relay_command(list(read.get("command", command)), log, name + READ_SUFFIX)
        _grant(read, log.parent)
    return yaml.safe_dump(out, sort_keys=False)


def _grant(spec: dict[str, Any], directory: Path) -> None:
    sandbox = spec.setdefault("sandbox", {})
    if sandbox.get("enabled", True):
        sandbox["rw_paths"] = [*sandbox.get("rw_paths", []), str(directory)]


def http_relay_argv(upstream: str, log: Path, name: str, port_file: Path) -> list[str]:
    """The HTTP relay in front of ``upstream``, binding a free loopback port it writes to ``port_file``."""
    return [sys.executable, "-m", "proofline_kit.witness", "http", "--listen", "127.0.0.1:0", "--upstream", upstream,
            "--log", str(log), "--name", name, "--port-file", str(port_file)]
