"""A private ``redis-server`` (no persistence) that a test or the soak owns and may kill.

redis-server cannot report a port it picked, so a free port is chosen and tried: if another
process took it meanwhile, this server exits on the failed bind and another port is tried. A
server is only accepted once the process answering on the port is ours (``INFO``'s
``process_id`` is the pid we started). A restart after :meth:`kill` uses the same port (the
workers' broker URL names it) and fails loudly if that port was taken in between.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

from proofline_kit.processes import OwnedServer, own, unused_port, wait_for

ATTEMPTS = 5


class RedisServer(OwnedServer):
    """``start()`` / ``kill()`` (SIGKILL: everything it held is gone) / ``start()`` again / ``stop()``.
    With a ``password`` the server refuses every client that does not give it (``requirepass``);
    ``databases`` is how many numbered databases it has (Redis's default is 16)."""

    def __init__(self, workdir: Path, password: str | None = None, databases: int = 16) -> None:
        super().__init__(workdir)
        self.password = password
        self.databases = databases

    @property
    def base_url(self) -> str:
        """The server without a database number (what ``claim_redis_db`` takes)."""
        return f"redis://{f':{self.password}@' if self.password else ''}127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/0"

    def start(self) -> RedisServer:
        if self.port is not None:  # a restart: the same port, or a clear failure
            if not self._launch(self.port):
                raise RuntimeError(f"redis-server could not listen on port {self.port} again (taken meanwhile?)")
            return self
        for _ in range(ATTEMPTS):
            port = unused_port()
            if self._launch(port):
                self.port = port
                return self
        raise RuntimeError(f"redis-server found no free port in {ATTEMPTS} attempts")

    def _launch(self, port: int) -> bool:
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--databases", str(self.databases), "--daemonize", "no", "--dir", str(self.workdir),
                *(["--requirepass", self.password] if self.password else [])]
        with open(self.workdir / "redis.log", "ab") as log:
            proc = own(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        client = redis.Redis(host="127.0.0.1", port=port, password=self.password, socket_connect_timeout=0.2)

        def ours() -> str | None:
            if proc.poll() is not None:
                return "exited"
            try:
                return "ours" if client.info("server")["process_id"] == proc.pid else None
            except redis.RedisError:
                return None

        try:
            state = wait_for(ours, 20, what=f"redis-server on port {port}")
        finally:
            client.close()
        if state != "ours":
            proc.wait(5)
            return False
        return self.accepted(proc)

    def kill(self) -> None:
        """``kill -9``: no shutdown, no save; every queued and unacknowledged message is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
