"""The HTTP transport's view of its connections (worker/connect.py), which the tool-list cache
trusts: a server that closes an idle keep-alive connection (as a restarted server does) must make
the pool's connections count as changed before the next request is sent, whatever the installed
httpcore2 decides about expiry on its own."""

from __future__ import annotations

import asyncio

import anyio
import httpx2

from worker.connect import WatchedTransport

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


async def _serve_one(close: asyncio.Event, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer one request with keep-alive, then hold the connection until told to close it."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(RESPONSE)
    await writer.drain()
    await close.wait()
    writer.close()
    await writer.wait_closed()


async def _until(check, seconds: float = 10.0) -> bool:
    with anyio.move_on_after(seconds):
        while not check():
            await anyio.sleep(0.02)
        return True
    return False


def test_a_connection_the_server_closed_while_idle_is_no_longer_counted_as_open() -> None:
    async def scenario() -> None:
        close = asyncio.Event()
        server = await asyncio.start_server(lambda r, w: _serve_one(close, r, w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            # A keep-alive expiry far past the test, so that only the server's close can end it.
            pool = WatchedTransport(limits=httpx2.Limits(keepalive_expiry=600))
            async with httpx2.AsyncClient(transport=pool) as client:
                assert pool.open_connections() == frozenset()
                response = await client.get(f"http://127.0.0.1:{port}/")
                assert response.text == "ok"
                held = pool.open_connections()
                assert len(held) == 1, "the answered request leaves one idle keep-alive connection"
                # Nothing happened to it yet: still the same open connection.
                await anyio.sleep(0.1)
                assert pool.open_connections() == held
                close.set()  # the server ends the idle connection, as a restart does
                assert await _until(lambda: pool.open_connections() != held), \
                    "a connection the server closed was still counted as open"
                assert pool.open_connections() == frozenset()
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())
