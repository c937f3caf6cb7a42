"""A private RabbitMQ node that a test or the soak owns and may kill, so a broker crash never touches
the machine's own node (nor anyone else's queues on it).

It runs RabbitMQ's own start script with everything under one work directory: its node name
(``pl<hex>@localhost``), configuration (one AMQP listener on loopback), empty plugin list, Mnesia
and quorum-queue data, logs, and its Erlang cookie (``HOME``). No root is needed. The AMQP and
distribution ports are picked free and tried; a node that could not bind exits, and another pair is
tried. :meth:`kill` is SIGKILL of the node's process group (no clean shutdown); :meth:`start` again
brings the same node back on the same ports from the same data directory, so what its quorum queues
held survives, as on a real node.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

from kombu import Connection

from proofline_kit.processes import OwnedServer, own, stop_process, unused_port, wait_for
from proofline_kit.resources import RABBITMQ_SCRIPTS, rabbitmqctl

ATTEMPTS = 4
#: RabbitMQ's own scripts: the /usr/sbin wrappers switch to the rabbitmq user and write the system
#: node's startup log, so they are not used.
SCRIPTS = RABBITMQ_SCRIPTS


def available() -> bool:
    return (SCRIPTS / "rabbitmq-server").exists() and (SCRIPTS / "rabbitmqctl").exists()


class RabbitServer(OwnedServer):
    """``start()`` / ``kill()`` / ``start()`` again / ``stop()``; ``url`` is its default vhost."""

    def __init__(self, workdir: Path, node: str | None = None, cookie: str | None = None,
                 epmd_port: int | None = None) -> None:
        """``cookie`` and ``epmd_port`` are for a cluster's members (``proofline_kit/rabbitmq_cluster.py``):
        the Erlang cookie they share, and the port of the cluster's own epmd."""
        super().__init__(workdir)
        self.node = node or f"pl{uuid.uuid4().hex[:8]}@localhost"
        self.dist_port: int | None = None
        self.cookie = cookie
        self.epmd_port = epmd_port

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def ctl_env(self) -> dict[str, str]:
        """What ``rabbitmqctl -n node`` needs to reach this node: its cookie, under its HOME."""
        env = {"HOME": str(self.workdir), "ERL_EPMD_ADDRESS": "127.0.0.1"}
        if self.epmd_port is not None:
            env["ERL_EPMD_PORT"] = str(self.epmd_port)
        return env

    def start(self) -> RabbitServer:
        if self.port is not None:  # a restart: the same node, ports and data, or a clear failure
            if not self._launch(self.port, self.dist_port):
                raise RuntimeError(f"RabbitMQ node {self.node} could not start again on port {self.port}")
            return self
        for _ in range(ATTEMPTS):
            port, dist = unused_port(), unused_port()
            if port != dist and self._launch(port, dist):
                self.port, self.dist_port = port, dist
                return self
        raise RuntimeError(f"RabbitMQ found no free ports in {ATTEMPTS} attempts")

    def _launch(self, port: int, dist_port: int) -> bool:
        conf = self.workdir / "rabbitmq.conf"
        conf.write_text(f"listeners.tcp.local = 127.0.0.1:{port}\nloopback_users = none\n")
        plugins = self.workdir / "enabled_plugins"
        plugins.write_text("[].\n")
        if self.cookie is not None:  # Erlang reads it from $HOME and wants it readable by us alone
            cookie = self.workdir / ".erlang.cookie"
            if not cookie.exists():
                cookie.write_text(self.cookie)
                cookie.chmod(0o400)
        env = {**os.environ, **self.ctl_env, "RABBITMQ_NODENAME": self.node, "RABBITMQ_NODE_PORT": str(port),
               "RABBITMQ_DIST_PORT": str(dist_port), "RABBITMQ_CONFIG_FILE": str(conf),
               "RABBITMQ_ENABLED_PLUGINS_FILE": str(plugins), "RABBITMQ_MNESIA_BASE": str(self.workdir / "mnesia"),
               "RABBITMQ_LOG_BASE": str(self.workdir / "log"), "RABBITMQ_PID_FILE": str(self.workdir / "node.pid")}
        with open(self.workdir / "rabbitmq.out", "ab") as log:
            proc = own(subprocess.Popen([str(SCRIPTS / "rabbitmq-server")], env=env, stdout=log,
                                        stderr=subprocess.STDOUT, cwd=self.workdir, start_new_session=True))

        def up() -> str | None:
            if proc.poll() is not None:
                return "exited"
            try:
                with Connection(f"amqp://guest:guest@127.0.0.1:{port}//", connect_timeout=0.5) as conn:
                    conn.connect()
            except Exception:  # noqa: BLE001 - not listening yet
                return None
            return "up"

        state = wait_for(up, 90, interval=0.2, what=f"RabbitMQ node {self.node} on port {port}")
        if state != "up":
            proc.wait(10)
            return False
        # The port answered; make sure it is this node that answers (the node knows its own listener).
        listeners = rabbitmqctl(["eval", "rabbit_networking:active_listeners()."], self.node, self.ctl_env)
        if str(port) not in listeners:
            stop_process(proc, grace=5.0)
            return False
        return self.accepted(proc)

    def kill(self) -> None:
        """SIGKILL of the node (and its helpers): no clean shutdown, as in a machine crash."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(15)

    def stop(self, grace: float = 15.0) -> None:
        super().stop(grace)
