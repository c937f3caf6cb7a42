"""Egress by allowlist for sandboxed stdio servers: the destinations a server may reach, and the
forwarder on the worker's side that reaches them for it.

``sandbox: {network: {allow: ["127.0.0.1:8443", "api.example.com:443"]}}`` gives the server its own
network namespace (like ``network: false``) in which each allowed destination answers:

- a loopback destination (``127.0.0.0/8``, ``[::1]``) on the same address and port, so the server's
  client code is unchanged;
- a host name on an address of ``127.100.0.0/16`` that the sandbox's own ``/etc/hosts`` gives it
  (``/etc/nsswitch.conf`` says ``hosts: files``: no other name resolves), on the same port. TLS
  still checks the name: the bytes are relayed, not terminated.

Inside, worker/egress_relay.py listens there and relays each connection to a unix socket bound
into the sandbox; outside, :class:`Forwarder` (threads of the worker process) accepts on that socket
and connects to that socket's one destination, resolving a name with the worker's resolver. Nothing
else leaves the namespace. Why not packet filtering: ``nft`` rules in the sandbox's namespace need
``CAP_NET_ADMIN`` there, which bwrap would have to grant to the server too; the relay needs no
privilege at all. A non-loopback IP literal is refused for the same reason: giving the namespace
that address needs ``CAP_NET_ADMIN``. Name the host instead.

A connection to anything else fails inside (refused on loopback, no route elsewhere); the audit
(worker/sandbox_audit.py) records the failed ``connect`` as a ``network_denied`` violation, and
excuses the allowed addresses (:attr:`worker.sandbox.Roots.allowed`). TCP only.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import select
import shutil
import socket
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from worker import egress_relay

#: Where the forwarder's unix sockets appear inside the sandbox.
INSIDE_DIR = "/run/proofline-egress"
#: The addresses host names get inside the sandbox: 127.100.0.1, 127.100.0.2, ...
NAMED_BASE = ipaddress.IPv4Address("127.100.0.0")
MAX_ENTRIES = 64
#: How long the forwarder waits for a destination to accept a connection.
CONNECT_TIMEOUT_SECONDS = 10.0
#: Connections one forwarder relays at once; past it the sandbox's side is closed.
MAX_CONNECTIONS = 64
#: CA certificates, bound read-only when a server may reach a named host (TLS).
CA_PATHS = ("/etc/ssl", "/etc/ca-certificates")
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Destination:
    """One allowed destination: a loopback address or a host name, and a TCP port."""

    host: str
    port: int
    loopback: bool

    @property
    def text(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_entry(entry: object) -> Destination:
    """One ``allow`` entry (``host:port``, ``[v6]:port``) as a :class:`Destination`; a ValueError
    naming the entry and what is wrong with it otherwise."""

    def bad(why: str) -> ValueError:
        return ValueError(f"entry {entry!r}: {why}")

    if not isinstance(entry, str):
        raise bad("expected a string HOST:PORT")
    text = entry.strip()
    if "/" in text:
        raise bad("expected HOST:PORT, not a URL or a path")
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        if not close or not rest.startswith(":"):
            raise bad("an IPv6 address is written [ADDRESS]:PORT")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise bad("expected HOST:PORT (a port is required)")
        if ":" in host:
            raise bad("an IPv6 address is written [ADDRESS]:PORT")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise bad(f"port {port_text!r} is not a number from 1 to 65535")
    port = int(port_text)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None:
        if not address.is_loopback:
            raise bad("an IP address must be a loopback one (127.0.0.0/8 or [::1]); name a remote host by its DNS "
                      "name, which the sandbox maps onto its own loopback")
        return Destination(address.compressed, port, loopback=True)
    name = host.lower().rstrip(".")
    if name == "localhost":
        raise bad("write 127.0.0.1 or [::1] for this machine")
    if len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise bad(f"{host!r} is neither a loopback address nor a host name (no wildcards, no URLs)")
    return Destination(name, port, loopback=False)


class EgressPolicy(BaseModel):
    """``sandbox.network`` as a mapping: the only destinations the server may connect to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    allow: tuple[str, ...] = Field(min_length=1, max_length=MAX_ENTRIES, description=(
        "TCP destinations, each HOST:PORT or [ADDRESS]:PORT; an IP address must be a loopback one "
        "(127.0.0.0/8, ::1), a remote host is named by its DNS name"))

    @field_validator("allow", mode="before")
    @classmethod
    def _entries(cls, value: object) -> tuple[str, ...]:
        if not isinstance(value, list | tuple) or not value:
            raise ValueError("sandbox.network.allow must be a non-empty list of HOST:PORT entries")
        if len(value) > MAX_ENTRIES:
            raise ValueError(f"sandbox.network.allow holds {len(value)} entries; at most {MAX_ENTRIES}")
        seen: dict[str, object] = {}
        for entry in value:
            text = parse_entry(entry).text
            if text in seen:
                raise ValueError(f"entry {entry!r}: the same destination as {seen[text]!r}")
            seen[text] = entry
        return tuple(parse_entry(e).text for e in value)

    def destinations(self) -> list[Destination]:
        return [parse_entry(e) for e in self.allow]


@dataclass(frozen=True)
class Route:
    """Where one destination answers inside the sandbox, and the unix socket behind it."""

    destination: Destination
    listen: str
    socket_name: str

    @property
    def inside(self) -> str:
        """The address as the sandbox's audit sees a connect to it (``host:port``)."""
        return f"{self.listen}:{self.destination.port}"


def routes(policy: EgressPolicy) -> list[Route]:
    """Each destination's listening address inside: a loopback one as it is, a name on the next
    free address of ``127.100.0.0/16`` (one per name; a port already taken there is skipped)."""
    dests = policy.destinations()
    taken = {(d.host, d.port) for d in dests if d.loopback}
    ports = {d.port for d in dests}
    names: dict[str, str] = {}
    out: list[Route] = []
    n = 0
    for i, d in enumerate(dests):
        listen = d.host
        if not d.loopback:
            if d.host not in names:
                n += 1
                while any((str(NAMED_BASE + n), p) in taken for p in ports):
                    n += 1
                names[d.host] = str(NAMED_BASE + n)
            listen = names[d.host]
        out.append(Route(d, listen, f"{i}.sock"))
    return out


@dataclass(frozen=True)
class EgressPlan:
    """What a sandbox launch needs to know of a running :class:`Forwarder` (pure data)."""

    routes: tuple[Route, ...]
    sockets_dir: str
    hosts_file: str
    nsswitch_file: str

    def bwrap_args(self, exists=os.path.exists) -> list[str]:
        """The binds: the sockets read-only at :data:`INSIDE_DIR`, the sandbox's own name files, and
        the CA certificates when a named host may be reached."""
        args = ["--ro-bind", self.sockets_dir, INSIDE_DIR, "--ro-bind", self.hosts_file, "/etc/hosts",
                "--ro-bind", self.nsswitch_file, "/etc/nsswitch.conf"]
        if any(not r.destination.loopback for r in self.routes):
            for path in CA_PATHS:
                if exists(path):
                    args += ["--ro-bind", path, path]
        return args

    def inside_paths(self, exists=os.path.exists) -> tuple[str, ...]:
        named = any(not r.destination.loopback for r in self.routes)
        return (INSIDE_DIR, "/etc/hosts", "/etc/nsswitch.conf",
                *(p for p in CA_PATHS if named and exists(p)))

    def relay_command(self, python: str, command: Sequence[str]) -> list[str]:
        """``command`` started behind the in-sandbox relay (worker/egress_relay.py)."""
        argv = [python, "-I", "-S", egress_relay.__file__]
        for r in self.routes:
            host = f"[{r.listen}]" if ":" in r.listen else r.listen
            argv += ["--route", f"{host}:{r.destination.port}={INSIDE_DIR}/{r.socket_name}"]
        return [*argv, "--", *command]

    @property
    def allowed(self) -> tuple[str, ...]:
        return tuple(r.inside for r in self.routes)


def hosts_text(route_list: Sequence[Route]) -> str:
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
    names = dict.fromkeys((r.listen, r.destination.host) for r in route_list if not r.destination.loopback)
    return "\n".join([*lines, *(f"{a} {n}" for a, n in names)]) + "\n"


class Forwarder:
    """The worker's side of one sandbox's egress: a unix socket per allowed destination, in a private
    directory bound into the sandbox, each connected on accept to its destination and nothing else.

    Threads of the worker process (nothing to orphan); :meth:`close` ends them and removes the folder."""

    def __init__(self, server: str, role: str, policy: EgressPolicy) -> None:
        self.server, self.role = server, role
        self.routes = tuple(routes(policy))
        self.directory = tempfile.mkdtemp(prefix="proofline-egress-")  # 0700, the worker's only
        sockets = os.path.join(self.directory, "sockets")
        os.mkdir(sockets, 0o700)
        hosts = os.path.join(self.directory, "hosts")
        Path(hosts).write_text(hosts_text(self.routes))
        nsswitch = os.path.join(self.directory, "nsswitch.conf")
        Path(nsswitch).write_text("hosts: files\n")
        self.plan = EgressPlan(self.routes, sockets, hosts, nsswitch)
        #: Connections relayed to a destination so far (for tests and logs).
        self.connections = 0
        self._count = threading.Lock()
        self._listeners: dict[socket.socket, Route] = {}
        for route in self.routes:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(os.path.join(sockets, route.socket_name))
            sock.listen(16)
            self._listeners[sock] = route
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._accept, name=f"egress-{server}-{role}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([*self._listeners, self._wake_r], [], [])
            for sock in ready:
                if sock == self._wake_r:
                    continue
                try:
                    inside, _ = sock.accept()
                except OSError:
                    continue
                if not self._slots.acquire(blocking=False):
                    inside.close()
                    continue
                threading.Thread(target=self._forward, args=(inside, self._listeners[sock]), daemon=True).start()

    def _forward(self, inside: socket.socket, route: Route) -> None:
        dest = route.destination
        try:
            try:
                outside = socket.create_connection((dest.host, dest.port), timeout=CONNECT_TIMEOUT_SECONDS)
            except OSError as exc:
                log.warning("egress destination unreachable", extra={
                    "event": "sandbox_egress_failed", "server": self.server, "role": self.role,
                    "destination": dest.text, "error": str(exc)})
                inside.close()
                return
            outside.settimeout(None)
            with self._count:
                self.connections += 1
            egress_relay.pump(inside, outside)
        finally:
            self._slots.release()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=2)
        for sock in self._listeners:
            sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        shutil.rmtree(self.directory, ignore_errors=True)
