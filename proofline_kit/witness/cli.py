"""Command line of the witness relays.

    python -m proofline_kit.witness stdio --log FILE --name NAME -- CMD [ARG...]
    python -m proofline_kit.witness http --listen 127.0.0.1:0 --upstream http://127.0.0.1:8765/mcp \\
        --log FILE --name NAME [--port-file F]

The HTTP relay binds the port it is given (0: any free one), writes the port it got to
``--port-file`` (atomically) and prints it as the first line of stdout, then runs until SIGTERM.
``--upstream-port-file`` instead of ``--upstream`` reads the server's port from a file at each new
connection, for a server that reports its own port.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from proofline_kit.witness.record import RecordWriter


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m proofline_kit.witness",
                                     description="Record every tools/call forwarded to an MCP server.")
    sub = parser.add_subparsers(dest="transport", required=True)
    stdio = sub.add_parser("stdio", help="relay a stdio server started as a child")
    http = sub.add_parser("http", help="relay a streamable-HTTP server on loopback")
    for p in (stdio, http):
        p.add_argument("--log", required=True, help="JSONL file the records are appended to")
        p.add_argument("--name", required=True, help="server name written on every record")
    stdio.add_argument("command", nargs=argparse.REMAINDER, help="-- the server's argv")
    http.add_argument("--listen", default="127.0.0.1:0", help="loopback host:port (port 0: any free port)")
    target = http.add_mutually_exclusive_group(required=True)
    target.add_argument("--upstream", help="the server's URL (only host and port are used)")
    target.add_argument("--upstream-port-file", type=Path, help="file holding the server's loopback port")
    http.add_argument("--port-file", type=Path, help="where to write the port the relay listens on")
    return parser


def _loopback(host: str) -> str:
    if host not in ("127.0.0.1", "::1", "localhost"):
        raise SystemExit(f"witness: {host} is not a loopback address; the relay listens on loopback only")
    return host


def _write_port(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


def _run_http(args: argparse.Namespace) -> None:
    # Imported here: the stdio relay, started once per sandboxed server, needs neither.
    import asyncio

    from proofline_kit.witness.http import HttpRelay

    host, _, port = args.listen.rpartition(":")
    upstream = None
    if args.upstream:
        parts = urlsplit(args.upstream)
        if parts.hostname is None or parts.port is None:
            raise SystemExit(f"witness: --upstream {args.upstream} needs a host and a port")
        upstream = (_loopback(parts.hostname), parts.port)
    relay = HttpRelay(RecordWriter(args.log), args.name, upstream, args.upstream_port_file)

    def bound(actual: int) -> None:
        if args.port_file is not None:
            _write_port(args.port_file, actual)
        print(actual, flush=True)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        for signo in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signo, task.cancel)
        try:
            await relay.serve(_loopback(host), int(port), bound)
        except asyncio.CancelledError:
            pass

    asyncio.run(run())


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.transport == "http":
        _run_http(args)
        return
    from proofline_kit.witness.stdio import exit_like, relay

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("witness stdio: give the server's command after --")
    sys.stdout.flush()
    exit_like(relay(command, args.log, args.name))
