"""The servers file: ``${VAR}`` expansion and paths relative to the file's own folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from proofline.errors import ConfigurationError, ServersVariableUnset
from worker.servers import load_servers


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "conf" / "servers.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_variables_expand_and_relative_paths_follow_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_TEST_DB", "/srv/data/shop.db")
    monkeypatch.setenv("PL_TEST_TOKEN_DIR", "secrets")
    path = write(tmp_path, """
servers:
  shop:
    transport: stdio
    command: ["venv/bin/shop-server", "--db", "${PL_TEST_DB}", "--price", "$$5"]
    env: {SHOP_DB: "${PL_TEST_DB}"}
    sandbox: {rw_paths: ["${PL_TEST_DB}"]}
    read_identity: {sandbox: {ro_paths: ["${PL_TEST_DB}"]}}
  api:
    transport: http
    url: http://127.0.0.1:9/mcp
    headers_from_files: {Authorization: "${PL_TEST_TOKEN_DIR}/writer"}
    read_identity: {headers_from_files: {Authorization: "/run/reader"}}
""")
    servers = load_servers(path)
    shop = servers["shop"]
    assert shop.write.command == (str(tmp_path / "conf" / "venv/bin/shop-server"), "--db", "/srv/data/shop.db",
                                  "--price", "$5")
    assert shop.read.command == shop.write.command
    assert shop.write.env == {"SHOP_DB": "/srv/data/shop.db"}
    assert shop.write.sandbox.rw_paths == ("/srv/data/shop.db",) and shop.read.sandbox.rw_paths == ()
    assert servers["api"].write.headers_from_files == {"Authorization": str(tmp_path / "conf" / "secrets/writer")}
    assert servers["api"].read.headers_from_files == {"Authorization": "/run/reader"}


def test_an_unset_variable_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PL_TEST_MISSING", raising=False)
    path = write(tmp_path, """
servers:
  shop:
    transport: stdio
    command: ["/usr/bin/shop", "--db", "${PL_TEST_MISSING}"]
    read_identity: {}
""")
    with pytest.raises(ServersVariableUnset) as raised:
        load_servers(path)
    assert raised.value.code == "servers_variable_unset"
    assert "servers.shop.command[2] names ${PL_TEST_MISSING}" in raised.value.detail and str(path) in raised.value.detail


def test_a_server_may_set_its_own_tool_list_age(tmp_path: Path) -> None:
    """``tool_list_max_age_seconds`` belongs to the server, not to its endpoints: it is read, kept
    for the server, and bounded like the setting (never negative)."""
    path = write(tmp_path, """
servers:
  fast:
    transport: http
    url: http://127.0.0.1:9/mcp
    tool_list_max_age_seconds: 5
    read_identity: {}
  default:
    transport: http
    url: http://127.0.0.1:9/mcp
    read_identity: {}
""")
    servers = load_servers(path)
    assert servers["fast"].tool_list_max_age_seconds == 5
    assert servers["default"].tool_list_max_age_seconds is None
    negative = write(tmp_path / "neg", path.read_text().replace(": 5", ": -1"))
    with pytest.raises(ConfigurationError, match="tool_list_max_age_seconds"):
        load_servers(negative)
