"""The system-of-record MCP server as a real subprocess, over stdio and over streamable HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError

from proofline_kit.processes import wait_port_file
from proofline_kit.sor import store
from proofline_kit.sor.server import IDEMPOTENCY_META_KEY

REPO = Path(__file__).resolve().parents[2]


def key(k: str) -> dict[str, str]:
    return {IDEMPOTENCY_META_KEY: k}


def server_env(db: Path, **extra: str) -> dict[str, str]:
    # StdioServerParameters merges this over a minimal default environment, not os.environ.
    return {"SOR_DB": str(db), "PYTHONPATH": str(REPO), "SOR_RESTART_SECONDS": "0.5", **extra}


def stdio(db: Path, role: str = "writer", **extra: str) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "proofline_kit.sor", "--transport", "stdio", "--role", role],
        env=server_env(db, **extra),
        cwd=str(REPO),
    )


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "sor.sqlite3"
    store.seed_demo(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_server(db: Path, role: str = "writer", *extra_args: str):
    """Start the server over streamable HTTP on a free loopback port; yield its MCP URL."""
    port_file = db.with_name(f"{db.stem}-{role}-{uuid.uuid4().hex[:8]}.port")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proofline_kit.sor", "--transport", "http", "--port", "0",
         "--port-file", str(port_file), "--role", role, *extra_args],
        env={**os.environ, **server_env(db)},
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port = wait_port_file(port_file, proc, timeout=15)  # the server binds port 0 and reports it
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        # uvicorn drains in-flight requests on SIGTERM; a dropped response sleeps for an hour.
        proc.terminate()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_stdio_writer_tools_and_dedup(db: Path) -> None:
    progress: list[tuple[float, float | None, str | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, total, message))

    async def main() -> None:
        async with Client(stdio(db), read_timeout_seconds=10) as client:
            args = {"tenant": "acme", "title": "Disk full", "owner": "alice"}
            first = await client.call_tool("create_ticket", args, meta=key("k1"))
            again = await client.call_tool("create_ticket", args, meta=key("k1"))
            assert first.structured_content == {**again.structured_content, "deduplicated": False}
            assert again.structured_content["deduplicated"] is True
            assert store.count_effects(db, "k1") == 1

            found = await client.call_tool("find_ticket_by_key", {"idempotency_key": "k1"})
            assert found.structured_content["ticket"]["id"] == first.structured_content["ticket_id"]

            # issue_refund does not honour the key, and answers in text only.
            refund_args = {"account": "acct-1", "tenant": "acme", "amount_cents": 1500, "reason": "late"}
            for _ in range(2):
                refund = await client.call_tool("issue_refund", refund_args, meta=key("r1"))
                assert refund.structured_content is None
                assert re.fullmatch(r"refund R-\d+ issued for 1500 cents on acct-1", refund.content[0].text)
            assert store.count_effects(db, "r1") == 2

            service = await client.call_tool("get_service", {"service": "checkout"})
            assert service.structured_content is None
            doc = json.loads(service.content[0].text)
            assert doc["state"] == "running" and doc["generation"] == 1

            started = await client.call_tool(
                "restart_service",
                {"service": "checkout", "tenant": "acme", "expected_generation": 1},
                progress_callback=on_progress,
                meta=key("rs1"),
            )
            assert started.structured_content["state"] == "accepted"
            conflict = await client.call_tool(
                "restart_service", {"service": "checkout", "tenant": "acme", "expected_generation": 2}
            )
            assert conflict.is_error
            assert conflict.structured_content["error_class"] == "failed_before_side_effect"
            assert "conflicting_operation" in conflict.structured_content["message"]

    anyio.run(main)
    assert len(progress) >= 2


def test_reader_role_refuses_writes_and_reads_outage(db: Path) -> None:
    async def main() -> None:
        async with Client(stdio(db, role="reader"), read_timeout_seconds=10) as client:
            refused = await client.call_tool(
                "create_ticket", {"tenant": "acme", "title": "t", "owner": "o"}, meta=key("k1")
            )
            assert refused.is_error
            assert refused.structured_content["error_class"] == "failed_before_side_effect"
            assert refused.structured_content["message"] == "read-only identity"

            read = await client.call_tool("get_ticket", {"ticket_id": "T-1"})
            assert read.structured_content["found"] is True

            store.set_read_outage(db)
            down = await client.call_tool("get_account", {"account": "acct-1"})
            assert down.is_error and down.structured_content["error_class"] == "unavailable"

    anyio.run(main)
    assert store.effects(db) == []


def test_drop_response_times_out_but_effect_is_applied(db: Path) -> None:
    store.set_fault(db, "create_ticket", "drop_response")

    async def main() -> None:
        async with Client(stdio(db), read_timeout_seconds=1) as client:
            args = {"tenant": "acme", "title": "lost answer", "owner": "o"}
            with pytest.raises(MCPError):
                await client.call_tool("create_ticket", args, meta=key("k-drop"))
            # The fault was a single shot: the retry is deduplicated against the applied effect.
            retry = await client.call_tool("create_ticket", args, meta=key("k-drop"))
            assert retry.structured_content["deduplicated"] is True

    anyio.run(main)
    assert store.count_effects(db, "k-drop") == 1


def test_commit_faults_and_lie(db: Path) -> None:
    async def main() -> None:
        async with Client(stdio(db), read_timeout_seconds=10) as client:
            args = {"ticket_id": "T-1", "expected_version": 1}
            store.set_fault(db, "close_ticket", "fail_before_commit")
            before = await client.call_tool("close_ticket", args, meta=key("c1"))
            assert before.structured_content["error_class"] == "failed_before_side_effect"
            assert store.count_effects(db, "c1") == 0

            store.set_fault(db, "close_ticket", "fail_after_commit")
            after = await client.call_tool("close_ticket", args, meta=key("c1"))
            assert after.structured_content["error_class"] == "failed_after_side_effect"
            assert store.count_effects(db, "c1") == 1

            store.set_fault(db, "issue_refund", "lie")
            lie = await client.call_tool(
                "issue_refund",
                {"account": "acct-1", "tenant": "acme", "amount_cents": 10, "reason": "x"},
                meta=key("r-lie"),
            )
            refund_id = re.search(r"R-\d+", lie.content[0].text).group(0)
            assert store.count_effects(db, "r-lie") == 0
            missing = await client.call_tool("find_refund_by_key", {"idempotency_key": "r-lie"})
            assert missing.structured_content["found"] is False
            account = await client.call_tool("get_account", {"account": "acct-1"})
            assert refund_id not in {r["id"] for r in account.structured_content["refunds"]}

    anyio.run(main)


def test_contract_variant_and_version_come_from_env(db: Path) -> None:
    async def describe(params: StdioServerParameters) -> tuple[str, dict[str, dict]]:
        async with Client(params, read_timeout_seconds=10) as client:
            tools = await client.list_tools(cache_mode="bypass")  # never a cached listing for a contract
            return client.server_info.version, {t.name: t.input_schema for t in tools.tools}

    async def main() -> None:
        version1, v1 = await describe(stdio(db))
        version2, v2 = await describe(stdio(db, SOR_CONTRACT_VARIANT="2", SOR_VERSION="2.0.0"))
        assert (version1, version2) == ("1.0.0", "2.0.0")
        assert "priority" not in v1["create_ticket"]["properties"]
        assert "priority" in v2["create_ticket"]["properties"]
        assert {k: v for k, v in v1.items() if k != "create_ticket"} == {
            k: v for k, v in v2.items() if k != "create_ticket"
        }

    anyio.run(main)


def test_streamable_http_transport(db: Path) -> None:
    with http_server(db) as url:

        async def main() -> None:
            async with Client(url, read_timeout_seconds=10) as client:
                assert (client.server_info.name, client.server_info.version) == ("proofline-sor", "1.0.0")
                args = {"tenant": "acme", "title": "over http", "owner": "o"}
                first = await client.call_tool("create_ticket", args, meta=key("h1"))
                again = await client.call_tool("create_ticket", args, meta=key("h1"))
                assert again.structured_content["ticket_id"] == first.structured_content["ticket_id"]
                assert again.structured_content["deduplicated"] is True

            store.set_fault(db, "create_ticket", "drop_response", delay_seconds=1.5)
            async with Client(url, read_timeout_seconds=1) as client:
                with pytest.raises(Exception):  # noqa: B017 - HTTP may surface a timeout or a cancellation
                    await client.call_tool("create_ticket", {**args, "title": "dropped"}, meta=key("h2"))

        anyio.run(main)
    assert store.count_effects(db, "h1") == 1
    assert store.count_effects(db, "h2") == 1


def test_http_progress_needs_sse_mode(db: Path) -> None:
    """JSON-response mode cannot carry notifications; ``--sse`` streams them."""
    progress: list[float] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(done)

    with http_server(db, "writer", "--sse") as url:

        async def main() -> None:
            async with Client(url, read_timeout_seconds=10) as client:
                started = await client.call_tool(
                    "restart_service",
                    {"service": "search", "tenant": "acme", "expected_generation": 1},
                    progress_callback=on_progress,
                )
                assert started.structured_content["state"] == "accepted"

        anyio.run(main)
    assert progress == [1, 2, 3]
