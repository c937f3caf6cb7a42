"""What the tool-list cache saves per action: ``python -m ops.tool_list_bench [--n 300]``.

Revalidation checks the approved tool contract against the server's tool list. This measures, in
one run, against the demo system of record over streamable HTTP (SSE responses, as the test stack
runs it; one server process, one worker
session as ``worker/mcp_client.py`` keeps it), the cost per action of

- one precondition read (``find_ticket_by_key``, the baseline: one MCP request of the three every
  action makes),
- the contract check listing the tools live (``tool_list_max_age_seconds: 0``, as before the cache),
- the contract check from the session's cache (the default),

each as wall time and CPU (this process plus the server process), and as a ratio of the baseline.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from proofline_kit.processes import start_process, stop_process, wait_port_file
from proofline_kit.sor import store as sor


def measure(fn: Callable[[], object], n: int, server: psutil.Process) -> tuple[float, float]:
    """(wall ms, CPU ms of this process and the server) per call, over ``n`` calls."""
    me = psutil.Process()

    def cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in (me, server))

    fn()  # warm
    cpu0, t0 = cpu(), time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) * 1000 / n, (cpu() - cpu0) * 1000 / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    n = parser.parse_args(argv).n
    from worker import calls
    from worker.mcp_client import McpSessions
    from worker.servers import Endpoint, Server

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        db = work / "sor.sqlite3"
        sor.init_db(db)
        port_file = work / "port"
        proc: subprocess.Popen = start_process(
            [sys.executable, "-m", "proofline_kit.sor", "--transport", "http", "--port", "0", "--port-file",
             str(port_file), "--role", "writer", "--db", str(db), "--sse"], {"SOR_DB": str(db), "PATH": "/usr/bin:/bin"},
            work / "sor.log")
        sessions = McpSessions(work)
        try:
            port = wait_port_file(port_file, proc)
            endpoint = Endpoint(transport="http", url=f"http://127.0.0.1:{port}/mcp")
            server = Server(name="sor", write=endpoint, read=endpoint)
            served = psutil.Process(proc.pid)

            def read() -> object:
                return sessions.run(server, "write", lambda c: calls.read_tool(
                    c, tool="find_ticket_by_key", arguments={"idempotency_key": "absent"}, timeout_seconds=5))

            rows = [("precondition read (baseline: one MCP request)", *measure(read, n, served)),
                    ("contract check, tools listed live (max age 0)",
                     *measure(lambda: sessions.tool_hashes(server, 0.0), n, served)),
                    ("contract check from the session's cache",
                     *measure(lambda: sessions.tool_hashes(server, 60.0), n, served))]
        finally:
            sessions.close()
            stop_process(proc)
    base_wall, base_cpu = rows[0][1], rows[0][2]
    print(f"{'per action':<50} {'wall ms':>9} {'CPU ms':>9} {'wall ratio':>11} {'CPU ratio':>10}")
    for label, wall, cpu in rows:
        print(f"{label:<50} {wall:9.3f} {cpu:9.3f} {wall / base_wall:11.3f} {cpu / base_cpu:10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
