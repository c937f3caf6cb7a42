"""Start the kit's authorization server as a process and drive its test controls."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx

from proofline_kit.processes import start_process, stop_process, wait_port_file

#: The clients a test deployment registers: one per identity of the system of record, and a
#: loopback client an operator logs in with (``proofline servers login``).
DEFAULT_CLIENTS: dict[str, dict[str, Any]] = {
    "sor-writer": {"secret": "writer-secret-7f3a9c", "grant_types": ["client_credentials"], "scope": "sor:write"},
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
