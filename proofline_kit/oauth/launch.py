"""Start the kit's authorization server as a process and drive its test controls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import yaml

from proofline_kit.oauth.authorization import EXCHANGE_GRANT
from proofline_kit.processes import start_process, stop_process, wait_port_file
from proofline_kit.stack import Stack, build_stack, start_workers, teardown_stack
from worker.servers import load_servers

#: The clients a test deployment registers: one per identity of the system of record (the writer
#: may exchange its tokens, RFC 8693), and a loopback client an operator logs in with
#: (``proofline servers login``).
DEFAULT_CLIENTS: dict[str, dict[str, Any]] = {
    "sor-writer": {"secret": "writer-secret-7f3a9c", "grant_types": ["client_credentials", EXCHANGE_GRANT],
                   "scope": "sor:write"},
    "sor-reader": {"secret": "reader-secret-2b8e41", "grant_types": ["client_credentials"], "scope": "sor:read"},
    "operator-cli": {"grant_types": ["authorization_code", "refresh_token"], "scope": "sor:write", "loopback": True},
}


@dataclass
class AuthorizationServer:
    url: str
    process: subprocess.Popen
    clients: dict[str, dict[str, Any]]

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/admin/stats", timeout=5).json()

    def revoke_client(self, client_id: str) -> int:
        return int(httpx.post(f"{self.url}/admin/revoke", json={"client_id": client_id}, timeout=5).json()["revoked"])

    def token_values(self) -> list[str]:
        """Every access and refresh token the server ever issued."""
        return list(httpx.get(f"{self.url}/admin/tokens", timeout=5).json()["values"])

    def set_lifetime(self, seconds: float) -> None:
        httpx.post(f"{self.url}/admin/lifetime", json={"access": seconds}, timeout=5).raise_for_status()

    def set_exchange_mode(self, mode: str, advertised: bool = True) -> None:
        """How the token-exchange grant behaves from now on (``EXCHANGE_MODES``), and whether the
        server's metadata lists it."""
        httpx.post(f"{self.url}/admin/exchange", json={"mode": mode, "advertised": advertised},
                   timeout=5).raise_for_status()

    def write_secret(self, client_id: str, path: Path) -> str:
        """The client's secret in a 0600 file, as an operator would deploy it."""
        path.write_text(self.clients[client_id]["secret"] + "\n")
        path.chmod(0o600)
        return str(path)

    def stop(self) -> None:
        stop_process(self.process, grace=3)


def start_authorization_server(workdir: Path, env: dict[str, str], access_lifetime: float = 300.0,
                               clients: dict[str, dict[str, Any]] | None = None) -> AuthorizationServer:
    workdir.mkdir(parents=True, exist_ok=True)
    clients = clients or DEFAULT_CLIENTS
    clients_file = workdir / "oauth-clients.json"
    clients_file.write_text(json.dumps(clients))
    port_file = workdir / "oauth-as.port"
    port_file.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "proofline_kit.oauth", "--clients", str(clients_file), "--port-file", str(port_file),
            "--access-lifetime", str(access_lifetime)]
    proc = start_process(argv, env, workdir / "oauth-as.log")
    try:
        port = wait_port_file(port_file, proc)
    except BaseException:
        stop_process(proc)
        raise
    return AuthorizationServer(f"http://127.0.0.1:{port}", proc, clients)


@contextmanager
def oauth_stack(tmp: Path, writer: dict[str, Any], reader: dict[str, Any],
                clients: dict[str, dict[str, Any]] | None = None, server_env: dict[str, str] | None = None,
                concurrency: int = 2) -> Iterator[tuple[Stack, AuthorizationServer]]:
    """An authorization server, an HTTP stack whose system of record requires its tokens, and workers
    whose servers file gives the writer and the reader the ``auth:`` blocks ``writer`` and ``reader``
    (each with its client's secret in a file; the writer's pinned to this server as its ``issuer``);
    ``concurrency`` pool processes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "SOR_"))}
    auth = start_authorization_server(tmp / "as", env, clients=clients)
    try:
        stack = build_stack("http", tmp / "stack", server_env={"SOR_OAUTH_ISSUER": auth.url, **(server_env or {})})
    except BaseException:
        auth.stop()
        raise
    try:
        doc = yaml.safe_load(stack.servers_file.read_text())
        sor = doc["servers"]["sor"]
        for target, block in ((sor, {"issuer": auth.url, **writer}), (sor["read_identity"], reader)):
            client = str(block["client_id"])
            target["auth"] = {"type": "oauth", **block,
                              "client_secret_file": auth.write_secret(client, tmp / f"{client}.secret")}
        stack.servers_file.write_text(yaml.safe_dump(doc))
        load_servers.cache_clear()
        start_workers(stack, concurrency=concurrency)
        yield stack, auth
    finally:
        teardown_stack(stack)
        auth.stop()
        load_servers.cache_clear()
