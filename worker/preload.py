"""What the worker's main process loads before it forks its pool, so a new pool process does not.

A pool process that Celery starts in place of a killed or recycled one inherits the main process's
memory. Whatever is loaded only on first use (modules some libraries import inside a function, the
contracts and servers files, their compiled conditions) is paid for again by every new pool process,
on its first action, and under frequent losses on a busy machine that first action is most of what
a process does. Measured on a new pool process (sampling profiler, 2026-12-03): the MCP SDK imports
``jsonschema`` (with ``referencing``, ``rpds``, ``attrs``) when it first validates a tool result,
anyio imports its asyncio backend when the first portal starts, and the recovery modules the
settled-action hooks use are imported on first settle: together most of the first action's extra
time. :func:`modules` imports them in the main process (``worker/tasks.py`` at import);
:func:`configuration` reads the contracts and servers files there (at ``worker_init``), so the
children start with the same parsed, compiled copies. Both only warm caches: a module that cannot be
imported, or a file that cannot be read, is left to fail where it is used, with its own message.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)

#: Modules imported on first use by the libraries and hooks a pool process runs (see above).
MODULES = (
    "jsonschema", "jsonschema.validators", "referencing", "anyio._backends._asyncio", "anyio.streams.stapled",
    "anyio.streams.tls", "importlib.resources.readers",
    "ledger.heartbeat", "recovery.authority_watch", "recovery.backlog", "recovery.expiry", "recovery.recheck_sweep",
    "recovery.reconciler", "recovery.sweep_gate", "recovery.verify", "recovery.recover", "recovery.recheck",
)


#: The libraries a worker's Celery process imports at start, imported by its supervisor before it
#: forks the run (``proofline/supervise.py``). Third-party only: none reads the environment or the
#: settings, starts a thread or opens a connection when imported (the product's own modules do read
#: settings at import, so the run imports those itself).
LIBRARIES = (
    "mcp", "mcp.types", "mcp.client.session", "mcp.client.stdio", "mcp.client.streamable_http",
    "mcp.server.lowlevel", "anyio", "anyio._backends._asyncio", "httpx2", "pydantic", "pydantic_settings",
    "celery", "celery.app", "celery.bin.celery", "celery.worker", "celery.apps.worker",
    "celery.concurrency.prefork", "kombu", "kombu.transport.redis", "redis", "redis.asyncio", "psycopg",
    "sqlalchemy", "sqlalchemy.orm", "cel", "click", "yaml", "jsonschema",
    "cryptography.hazmat.primitives.asymmetric.ed25519", "psutil", "rfc8785", "setproctitle",
)


def modules(names: tuple[str, ...] = MODULES) -> list[str]:
    """Import ``names``; returns those that could not be imported (left to their first use)."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def configuration(contracts_dir: Path, servers_file: Path) -> None:
    """Parse the contracts and the servers file into the process's caches."""
    from proofline.contracts import load_contracts
    from proofline.errors import ProoflineError
    from worker.servers import load_servers

    for load, path in ((load_contracts, contracts_dir), (load_servers, servers_file)):
        try:
            load(Path(path))
        except (ProoflineError, OSError) as exc:
            log.debug("not preloaded: %s", exc)
