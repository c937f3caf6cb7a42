"""Network faults between an MCP client and the system-of-record server over streamable HTTP.

The server runs as a subprocess (plain JSON responses, and event-stream responses as the Celery
stack runs it); the fault proxy sits in front. For each fault: what the MCP 2.3 client sees, and
whether the server applied the write (the effects log is the ground truth).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

from proofline_kit.faults import FaultProxy
from proofline_kit.processes import wait_for, wait_port_file
from proofline_kit.sor import store

REPO = Path(__file__).resolve().parents[2]
ARGS = {"tenant": "acme", "title": "Disk full", "owner": "alice"}
TIMEOUT_CODE = -32001


def key(k: str) -> dict[str, str]:
    return {"proofline/idempotency_key": k}


class Sor:
    def __init__(self, db: Path, port: int) -> None:
        self.db = db
        self.port = port

    def effects(self, k: str) -> int:
        return store.count_effects(self.db, k)


@pytest.fixture(scope="module", params=["json", "sse"])
def sor(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sor]:
    """The system of record over HTTP as a subprocess, on a fresh SQLite file."""
    db = tmp_path_factory.mktemp(f"sor-{request.param}") / "sor.sqlite3"
    store.init_db(db)
    store.seed_demo(db)
    port_file = db.with_name("sor.port")
    argv = [sys.executable, "-m", "proofline_kit.sor", "--transport", "http", "--port", "0", "--port-file",
            str(port_file), "--db", str(db)]
    if request.param == "sse":
        argv.append("--sse")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = wait_port_file(port_file, proc)  # the server binds a port of its choosing and reports it
        yield Sor(db, port)
    finally:
        # uvicorn waits for in-flight (hung) requests on SIGTERM: kill it after 2 s.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def proxy(sor: Sor) -> Iterator[FaultProxy]:
    with FaultProxy(listen_port=0, target=("127.0.0.1", sor.port)) as p:
        yield p


def url(proxy: FaultProxy) -> str:
    return f"http://127.0.0.1:{proxy.port}/mcp"


def test_blackhole_times_out_after_the_server_applied_the_write(sor: Sor, proxy: FaultProxy) -> None:
    async def main() -> None:
        async with Client(url(proxy), read_timeout_seconds=1) as client:
            warm = await client.call_tool("create_ticket", ARGS, meta=key("bh-warm"))
            assert warm.structured_content["deduplicated"] is False
            proxy.set_mode("blackhole")  # the client's keep-alive connection is already open
            with pytest.raises(MCPError) as info:
                await client.call_tool("create_ticket", ARGS, meta=key("bh"))
            assert info.value.error.code == TIMEOUT_CODE
            assert sor.effects("bh") == 1  # the server acted; only the answer was lost
            assert proxy.stats()["responses_dropped"] >= 1
            # Healed: the same client retries with the same key and gets the recorded result.
            proxy.set_mode("pass")
            retry = await client.call_tool("create_ticket", ARGS, meta=key("bh"))
            assert retry.structured_content["deduplicated"] is True

    anyio.run(main)
    assert sor.effects("bh") == 1


def test_blackhole_switched_while_the_call_is_in_flight(sor: Sor, proxy: FaultProxy) -> None:
    async def main() -> None:
        async with Client(url(proxy), read_timeout_seconds=2) as client:
            await client.call_tool("create_ticket", ARGS, meta=key("fl-warm"))
            store.set_fault(sor.db, "create_ticket", "delay", delay_seconds=0.5)  # the server works slowly
            sent = proxy.stats()["bytes_client_to_server"]

            async def flip_when_request_forwarded() -> None:
                while proxy.stats()["bytes_client_to_server"] == sent:
                    await anyio.sleep(0.005)
                proxy.set_mode("blackhole")

            async with anyio.create_task_group() as tg:
                tg.start_soon(flip_when_request_forwarded)
                with pytest.raises(MCPError) as info:
                    await client.call_tool("create_ticket", ARGS, meta=key("fl"))
            assert info.value.error.code == TIMEOUT_CODE
            wait_for(lambda: sor.effects("fl") == 1, what="the effect")

    anyio.run(main)


def test_blackhole_holding_the_clients_close_lets_a_slow_write_finish(sor: Sor, proxy: FaultProxy) -> None:
    # The client gives up (timeout) and closes its connection while the server is still working.
    # An event-stream server would cancel the tool on that close; a partition loses the close.
    async def main() -> None:
        async with Client(url(proxy), read_timeout_seconds=0.3) as client:
            await client.call_tool("create_ticket", ARGS, meta=key("hc-warm"))
            store.set_fault(sor.db, "create_ticket", "delay", delay_seconds=0.8)
            proxy.set_mode("blackhole", forward_close=False)
            with pytest.raises(MCPError) as info:
                await client.call_tool("create_ticket", ARGS, meta=key("hc"))
            assert info.value.error.code == TIMEOUT_CODE
            wait_for(lambda: sor.effects("hc") == 1, what="the slow write to be applied")
            proxy.set_mode("pass")
            retry = await client.call_tool("create_ticket", ARGS, meta=key("hc"))
            assert retry.structured_content["deduplicated"] is True

    anyio.run(main)


def test_reset_after_request_fails_the_call_after_the_write(sor: Sor, proxy: FaultProxy) -> None:
    async def main() -> None:
        async with Client(url(proxy), read_timeout_seconds=5) as client:
            await client.call_tool("create_ticket", ARGS, meta=key("rs-warm"))
            proxy.set_mode("reset", after_request=True)
            # call_tool itself is cancelled; the transport error surfaces at the client context.
            await client.call_tool("create_ticket", ARGS, meta=key("rs"))
        raise AssertionError("the call should not have returned")

    with pytest.raises(BaseExceptionGroup) as info:
        anyio.run(main)
    assert info.group_contains(httpx2.TransportError, depth=None)
    assert sor.effects("rs") == 1
    assert proxy.stats()["resets_sent"] == 1


def test_refuse_fails_a_new_client_and_nothing_is_applied(sor: Sor, proxy: FaultProxy) -> None:
    port = proxy.port
    proxy.set_mode("refuse")

    async def refused() -> None:
        async with Client(url(proxy), read_timeout_seconds=2) as client:
            await client.call_tool("create_ticket", ARGS, meta=key("rf"))

    with pytest.raises(BaseExceptionGroup) as info:
        anyio.run(refused)
    assert info.group_contains(httpx2.ConnectError, depth=None)
    assert sor.effects("rf") == 0

    proxy.set_mode("pass")
    assert proxy.port == port

    async def healed() -> None:
        async with Client(url(proxy), read_timeout_seconds=5) as client:
            first = await client.call_tool("create_ticket", ARGS, meta=key("rf"))
            assert first.structured_content["deduplicated"] is False
            again = await client.call_tool("create_ticket", ARGS, meta=key("rf"))
            assert again.structured_content["deduplicated"] is True

    anyio.run(healed)
    assert sor.effects("rf") == 1


def test_delay_beyond_the_read_timeout_looks_like_a_timeout(sor: Sor, proxy: FaultProxy) -> None:
    async def main() -> None:
        async with Client(url(proxy), read_timeout_seconds=0.5) as client:
            await client.call_tool("create_ticket", ARGS, meta=key("dl-warm"))
            proxy.set_mode("delay", seconds=30, direction="response")
            with pytest.raises(MCPError) as info:
                await client.call_tool("create_ticket", ARGS, meta=key("dl"))
            assert info.value.error.code == TIMEOUT_CODE
            proxy.set_mode("pass")
            retry = await client.call_tool("create_ticket", ARGS, meta=key("dl"))
            assert retry.structured_content["deduplicated"] is True

    anyio.run(main)
    assert sor.effects("dl") == 1
