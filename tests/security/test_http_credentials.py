"""Per-identity HTTP credentials from secret files, against a real server that requires them
(tests/security/credentialed_server.py): bearer headers, and mutual TLS."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from proofline.errors import ConfigurationError, McpUnavailable
from proofline_kit.processes import wait_port_file
from tests.conftest import start_process, stop_process
from worker.mcp_client import McpSessions
from worker.servers import load_servers

SERVER = Path(__file__).with_name("credentialed_server.py")
TOKENS = {"Bearer writer-token-1": "writer", "Bearer reader-token-2": "reader"}


def secret(path: Path, value: str) -> str:
    path.write_text(value + "\n")
    path.chmod(0o600)
    return str(path)


def servers(base: Path, spec: dict[str, Any], name: str = "api") -> Any:
    """One server (sessions are kept by server name: give each variant its own)."""
    path = base / f"servers-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump({"servers": {name: spec}}))
    load_servers.cache_clear()
    return load_servers(path)[name]


def seen(m: McpSessions, server: Any, role: str) -> dict[str, int]:
    async def go(client):  # noqa: ANN001
        return await client.call_tool("seen", {}, read_timeout_seconds=10)

    return m.run(server, role, go).structured_content["seen"]  # type: ignore[arg-type]


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[str]:
    proc = start_process([sys.executable, str(SERVER), str(tmp_path / "api.port"), json.dumps(TOKENS)], {},
                         tmp_path / "api.log")
    try:
        port = wait_port_file(tmp_path / "api.port", proc)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        stop_process(proc, grace=3)
        load_servers.cache_clear()


def test_each_identity_sends_its_own_token_from_its_file(tmp_path: Path, plain: str) -> None:
    writer = secret(tmp_path / "writer.token", "Bearer writer-token-1")
    reader = secret(tmp_path / "reader.token", "Bearer reader-token-2")
    server = servers(tmp_path, {"transport": "http", "url": plain, "headers_from_files": {"Authorization": writer},
                                "read_identity": {"headers_from_files": {"Authorization": reader}}})
    m = McpSessions(tmp_path)
    try:
        first = seen(m, server, "write")
        assert first.get("writer", 0) >= 1 and "reader" not in first
        by_reader = seen(m, server, "read")
        assert by_reader.get("reader", 0) >= 1
        assert seen(m, server, "write")["writer"] > first["writer"]
    finally:
        m.close()


def test_without_credentials_the_server_refuses_and_the_reader_inherits_none(tmp_path: Path, plain: str) -> None:
    writer = secret(tmp_path / "writer.token", "Bearer writer-token-1")
    # The read identity declares no credentials: it must not borrow the writer's.
    server = servers(tmp_path, {"transport": "http", "url": plain, "headers_from_files": {"Authorization": writer},
                                "read_identity": {}})
    assert server.read.headers_from_files == {}
    wrong = servers(tmp_path, {"transport": "http", "url": plain,
                               "headers_from_files": {"Authorization": secret(tmp_path / "bad", "Bearer nope")},
                               "read_identity": {}}, name="wrong")
    missing = servers(tmp_path, {"transport": "http", "url": plain,
                                 "headers_from_files": {"Authorization": str(tmp_path / "absent.token")},
                                 "read_identity": {}}, name="missing")
    m = McpSessions(tmp_path)
    try:
        assert seen(m, server, "write")["writer"] >= 1  # positive control
        with pytest.raises(McpUnavailable):
            seen(m, server, "read")
        with pytest.raises(McpUnavailable):
            seen(m, wrong, "write")
        with pytest.raises(McpUnavailable, match="absent.token"):
            seen(m, missing, "write")
    finally:
        m.close()


def test_credentials_belong_to_http_servers_only(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="http servers only"):
        servers(tmp_path, {"transport": "stdio", "command": ["true"], "headers_from_files": {"A": "/x"},
                           "read_identity": {}})
    with pytest.raises(ConfigurationError, match="stdio servers only"):
        servers(tmp_path, {"transport": "http", "url": "http://127.0.0.1:1/mcp", "sandbox": {"network": True},
                           "read_identity": {}})


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(d: Path) -> None:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", *ext, cwd=d)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_mutual_tls_with_a_client_certificate_from_files(tmp_path: Path) -> None:
    _certificates(tmp_path)
    proc = start_process([sys.executable, str(SERVER), str(tmp_path / "api.port"), json.dumps(TOKENS),
                          str(tmp_path / "server.pem"),
                          str(tmp_path / "server.key"), str(tmp_path / "ca.pem")], {}, tmp_path / "api.log")
    try:
        port = wait_port_file(tmp_path / "api.port", proc)  # the server bound port 0 and reported it
    except BaseException:
        stop_process(proc, grace=3)
        raise
    url = f"https://127.0.0.1:{port}/mcp"
    token = secret(tmp_path / "writer.token", "Bearer writer-token-1")
    server = servers(tmp_path, {
        "transport": "http", "url": url, "headers_from_files": {"Authorization": token},
        "client_cert_file": str(tmp_path / "client.pem"), "client_key_file": str(tmp_path / "client.key"),
        "ca_file": str(tmp_path / "ca.pem"),
        # The reader trusts the CA but presents no client certificate: the handshake is refused.
        "read_identity": {"headers_from_files": {"Authorization": token}}})
    assert server.read.client_cert_file is None and server.read.ca_file == str(tmp_path / "ca.pem")
    m = McpSessions(tmp_path)
    try:
        assert seen(m, server, "write")["writer"] >= 1
        with pytest.raises(McpUnavailable):
            seen(m, server, "read")
    finally:
        m.close()
        stop_process(proc, grace=3)
        load_servers.cache_clear()
