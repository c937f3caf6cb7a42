"""How a stdio endpoint of the servers file is started: the command line, environment and folder,
sandboxed by bubblewrap (worker/sandbox.py) and audited under strace when asked.

Pool processes wrap this in the SDK's ``StdioServerParameters`` (worker/connect.py); the node's
session host (worker/session_host.py) starts the very same command itself. Nothing here imports the
MCP SDK, so the host's process never pays for that import.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from worker import sandbox
from worker.sandbox_egress import Forwarder
from worker.sandbox_reader import Auditor
from worker.servers import Endpoint

log = logging.getLogger(__name__)

#: The variables a stdio server inherits from the process starting it, on POSIX: the same set the
#: SDK's stdio client copies (``mcp.client.stdio.get_default_environment``; a unit test keeps the
#: two equal). A sandboxed launch pins every one of them in its own environment.
INHERITED = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER")


def inherited_environment() -> dict[str, str]:
    """The starting process's values of :data:`INHERITED` (a shell function's value is never copied)."""
    return {key: value for key in INHERITED if (value := os.environ.get(key)) is not None
            and not value.startswith("()")}


def stdio_launch(endpoint: Endpoint, base_dir: Path, *, name: str = "?", role: str = "write",
                 environment: str = "development", status_path: str | None = None,
                 audit: Auditor | None = None, egress: Forwarder | None = None) -> sandbox.Launch:
    """The launch of a stdio ``endpoint``: sandboxed unless the servers file disables it with a
    reason (then logged as ``sandbox_disabled``), audited through ``audit``, reaching its egress
    allowlist through ``egress`` (without one it has no network). The result's ``env`` goes over
    :func:`inherited_environment`."""
    argv = endpoint.argv()
    cwd = endpoint.working_directory(base_dir)
    unsandboxed = sandbox.require_policy(name, role, endpoint.sandbox, environment)
    if unsandboxed is not None:
        log.warning("stdio server runs unsandboxed", extra={"event": "sandbox_disabled", "server": name,
                                                            "role": role, "reason": unsandboxed})
        return sandbox.Launch(argv[0], list(argv[1:]), dict(endpoint.stdio_environment()), cwd)
    roots: list[sandbox.Roots] = []
    launch = sandbox.launch(endpoint.sandbox, command=argv, env=endpoint.stdio_environment(), cwd=cwd,
                            base_dir=base_dir, status_path=status_path, roots=roots,
                            audit_path=audit.path if audit is not None else None,
                            egress=egress.plan if egress is not None else None)
    if audit is not None:
        audit.roots = roots[0]
    # The launcher environment pins every inherited variable, so what bwrap starts with is exactly
    # launch.env whoever starts it.
    return launch
