"""A stdio transport for MCP servers that never holds more than a bounded message in memory.

The SDK's own stdio reader (mcp 2.3) keeps a whole line in memory however long it is, and builds
it as ``buffer + chunk`` (quadratic in the line's length): a 20 MiB answer took 5.6-8.3 s to arrive
and raised the client's peak RSS by about 100 MB. This transport starts and stops the server with
the SDK's own process helpers, but reads stdout as bytes into a list of chunks and, once a line
passes ``max_message_bytes``, stops keeping it: the rest is only hashed and counted until its
newline. In place of the oversize message the session receives a JSON-RPC error for the same
request id (read from the message's first bytes) with code ``MESSAGE_TOO_LARGE`` (worker/stdio_lines.py) and the size,
sha256 and an excerpt in its data, so the call ends at once as a classified result instead of a
timeout. An oversize message whose id cannot be read is dropped (the request then times out).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TextIO

import anyio
import anyio.lowlevel
from mcp.client import stdio as sdk_stdio
from mcp.client.stdio import StdioServerParameters
from mcp.shared.message import SessionMessage

from worker.stdio_lines import Line, split_lines


class _Line(Line):
    """A :class:`~worker.stdio_lines.Line` that becomes a message for the SDK's session."""

    def finish(self) -> SessionMessage | Exception | None:
        raw = self.raw()
        if raw is None:
            return None
        return sdk_stdio._parse_line(raw.decode("utf-8", errors="replace"))  # noqa: SLF001 - the SDK's own parser


@asynccontextmanager
async def pumping(reader: Callable[[], Awaitable[None]], writer: Callable[[], Awaitable[None]],
                  shutdown: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    """Run a transport's ``reader`` and ``writer`` tasks while the session uses its streams; on the
    way out, ``shutdown`` runs shielded from cancellation (so it finishes however the session ended,
    a cancelled one included), then both tasks are cancelled."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        tg.start_soon(writer)
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await shutdown()
            tg.cancel_scope.cancel()


@asynccontextmanager
async def bounded_stdio_client(server: StdioServerParameters, max_message_bytes: int,
                               errlog: TextIO = sys.stderr) -> AsyncGenerator:
    """Like ``mcp.client.stdio.stdio_client``, with messages bounded to ``max_message_bytes``."""
    command = await sdk_stdio._get_executable_command(server.command)  # noqa: SLF001
    process = await sdk_stdio._create_platform_compatible_process(  # noqa: SLF001
        command=command, args=server.args, env=sdk_stdio.get_default_environment() | (server.env or {}),
        errlog=errlog, cwd=server.cwd)
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)
    writer_done = anyio.Event()

    async def stdout_reader() -> None:
        assert process.stdout is not None
        line = _Line(max_message_bytes)
        try:
            async with read_writer:
                try:
                    async for chunk in process.stdout:
                        done, line = split_lines(chunk, line)
                        for complete in done:
                            message = complete.finish()
                            if message is not None:
                                try:
                                    await read_writer.send(message)
                                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                                    return
                finally:
                    await sdk_stdio._drain_stdout(process)  # noqa: SLF001
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, ConnectionError):
            pass  # shutdown, or the server went away: the session sees the stream close

    async def stdin_writer() -> None:
        assert process.stdin is not None
        try:
            async with write_reader:
                async for message in write_reader:
                    body = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.stdin.send((body + "\n").encode(server.encoding, server.encoding_error_handler))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await read_writer.aclose()
        finally:
            writer_done.set()

    async def shutdown() -> None:
        read_stream.close()
        write_stream.close()
        with anyio.move_on_after(sdk_stdio._WRITER_FLUSH_TIMEOUT):  # noqa: SLF001
            await writer_done.wait()
        await sdk_stdio._stop_server_process(process)  # noqa: SLF001
        await sdk_stdio._aclose_all(read_stream, write_stream, read_writer, write_reader)  # noqa: SLF001
        await anyio.lowlevel.checkpoint()

    async with pumping(stdout_reader, stdin_writer, shutdown):
        yield read_stream, write_stream
