"""A private three-node RabbitMQ cluster that a test owns and may break: one node killed and brought
back while the workers run.

Each member is a :class:`~proofline_kit.rabbitmq_server.RabbitServer` (its own node name, AMQP and
distribution ports, data folder) under one work directory, with two things shared: the Erlang
cookie (a fresh random one, written to each member's ``HOME``) and an epmd of the cluster's own on
a port picked free, started in the foreground by this module. The nodes register with it and
nowhere else, so the machine's own epmd (and its nodes) is never touched, and stopping the cluster
ends every process it started: the three nodes' process groups, then epmd, each by pid.

The first node is the seed; the others join it (``stop_app``, ``join_cluster``, ``start_app``)
before anything declares a queue, so a quorum queue declared later gets a member on every node.
"""

from __future__ import annotations

import re
import secrets
import subprocess
from pathlib import Path

import psutil

from proofline_kit.processes import gone, start_process, stop_process, unused_port, wait_for
from proofline_kit.rabbitmq_server import RabbitServer
from proofline_kit.resources import RABBITMQ_SCRIPTS, rabbitmqctl

EPMD = "epmd"
_LEADER = re.compile(r"^(\S+)\s+(\S+@\S+)\s*$")


class RabbitCluster:
    """``start()`` forms the cluster; ``kill(node)`` / ``restart(node)`` one member; ``stop()`` all."""

    def __init__(self, workdir: Path, size: int = 3) -> None:
        self.workdir = workdir
        self.size = size
        self.cookie = secrets.token_hex(20)
        self.epmd_port: int | None = None
        self.epmd: subprocess.Popen | None = None
        self.nodes: list[RabbitServer] = []

    @property
    def url(self) -> str:
        """The broker URL list every process is given: each node's URL, ``;``-separated (kombu's failover)."""
        return ";".join(node.url for node in self.nodes)

    def node(self, name: str) -> RabbitServer:
        return next(n for n in self.nodes if n.node == name)

    def start(self) -> RabbitCluster:
        try:
            self._start_epmd()
            for i in range(self.size):
                home = self.workdir / f"node{i + 1}"
                home.mkdir(parents=True, exist_ok=True)
                member = RabbitServer(home, cookie=self.cookie, epmd_port=self.epmd_port)
                self.nodes.append(member)
                member.start()
            seed = self.nodes[0]
            for member in self.nodes[1:]:
                self.ctl(member, ["stop_app"])
                self.ctl(member, ["join_cluster", seed.node])
                self.ctl(member, ["start_app"])
            wait_for(lambda: self.running_nodes(seed) == sorted(n.node for n in self.nodes), 60,
                     what=f"{self.size} running nodes in the cluster")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_epmd(self) -> None:
        """epmd in the foreground, on loopback and a port of its own (tried until one binds)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for _ in range(4):
            port = unused_port()
            proc = start_process([EPMD, "-port", str(port), "-address", "127.0.0.1"], {"PATH": "/usr/bin:/bin"},
                                 self.workdir / "epmd.log", cwd=self.workdir)

            def listening(proc: subprocess.Popen = proc, port: int = port) -> str | None:
                if proc.poll() is not None:
                    return "exited"
                try:
                    conns = psutil.Process(proc.pid).net_connections("tcp")
                except psutil.NoSuchProcess:
                    return "exited"
                return "up" if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in conns) else None

            if wait_for(listening, 10, interval=0.05, what=f"epmd on port {port}") == "up":
                self.epmd, self.epmd_port = proc, port
                return
        raise RuntimeError("epmd found no free port in 4 attempts")

    def ctl(self, member: RabbitServer, args: list[str], timeout: float = 60.0) -> str:
        return rabbitmqctl(args, member.node, member.ctl_env, timeout=timeout)

    def running_nodes(self, member: RabbitServer) -> list[str]:
        out = self.ctl(member, ["eval", "lists:sort([atom_to_list(N) || N <- rabbit_nodes:all_running()])."])
        return sorted(re.findall(r'"([^"]+@[^"]+)"', out))

    def queue_leaders(self, via: RabbitServer | None = None, vhost: str = "/") -> dict[str, str]:
        """Each quorum queue's leader node, as a running member sees it."""
        member = via or next(n for n in self.nodes if n.running)
        out = self.ctl(member, ["list_queues", "-p", vhost, "--no-table-headers", "name", "leader"])
        return {m.group(1): m.group(2) for m in map(_LEADER.match, out.splitlines()) if m}

    def quorum_members(self, queue: str, via: RabbitServer | None = None, vhost: str = "/") -> list[str]:
        """The nodes holding a replica of ``queue`` (``rabbitmq-queues quorum_status``)."""
        member = via or next(n for n in self.nodes if n.running)
        argv = [str(RABBITMQ_SCRIPTS / "rabbitmq-queues"), "-q", "-n", member.node, "quorum_status", "-p", vhost, queue]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **member.ctl_env})
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stdout} {done.stderr}")
        return sorted(set(re.findall(r"\b(pl[0-9a-f]{8}@localhost)\b", done.stdout)))

    def kill(self, member: RabbitServer) -> None:
        """SIGKILL of one member's process group: no clean shutdown, its peers see it vanish."""
        member.kill()

    def restart(self, member: RabbitServer) -> None:
        """The same node again (same name, ports and data): it rejoins the cluster on its own."""
        member.start()
        wait_for(lambda: member.node in self.running_nodes(self.nodes[0] if self.nodes[0].running else member), 120,
                 what=f"{member.node} back in the cluster")

    def stop(self) -> None:
        """Every member (SIGTERM then SIGKILL of its process group), then epmd: only what we started."""
        for member in self.nodes:
            member.stop(grace=10.0)
        if self.epmd is not None:
            stop_process(self.epmd, grace=2.0)

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this cluster still alive: a node's beam.smp (by its node name) or our epmd."""
        names = {n.node for n in self.nodes}
        found = []
        for proc in psutil.process_iter(["name", "cmdline"]):
            try:
                argv = proc.info["cmdline"] or []
                if proc.info["name"] == "beam.smp" and (any(name in a for a in argv for name in names)
                                                        or self._ours(proc)):
                    found.append(proc)
                elif proc.info["name"] == "epmd" and self.epmd_port is not None and str(self.epmd_port) in argv:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return [p for p in found if not gone(p)]

    def _ours(self, proc: psutil.Process) -> bool:
        """A helper VM a node or its CLI started (epmd's starter, a CLI run): its HOME is a member's."""
        try:
            return proc.environ().get("HOME", "").startswith(str(self.workdir))
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            return False
