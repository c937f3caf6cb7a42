"""The in-sandbox half of egress by allowlist: listeners on the allowed addresses, relayed to unix sockets.

A sandbox with ``network: {allow: [...]}`` has its own network namespace, in which nothing but its
loopback exists. This script runs inside it, as the first program bwrap starts, with the worker's
interpreter in isolated mode (``python -I -S``: the standard library only, nothing of the
environment or the working directory)::

    python -I -S egress_relay.py --route 127.0.0.1:8443=/run/proofline-egress/0.sock ... -- SERVER ARGV

It binds one TCP listener per route, forks, and ``exec``\\ s the server in the original process (so
the server keeps the pid bwrap watches and its exit status is the sandbox's). The forked child
relays each accepted connection to the route's unix socket, bound from the worker's side, where
:class:`worker.sandbox_egress.Forwarder` connects it to the one destination that socket stands for.
The child asks the kernel to kill it when the server ends (``PR_SET_PDEATHSIG``), and bwrap's PID
namespace ends with the server anyway: nothing outlives the sandbox.

This side is not trusted: it runs as the server's uid and the server may kill or replace it. What
holds is outside: every unix socket reaches exactly one allowlisted destination, and an attempt to
reach anything else inside the namespace fails and is seen by the audit (worker/sandbox_audit.py).
"""

from __future__ import annotations

import os
import select
import socket
import sys
import threading

#: The routes one relay accepts at once; past it a connection is closed at once (counted by nobody:
#: the server sees a reset, and its own limits on processes and files bound it anyway).
MAX_CONNECTIONS = 32
CHUNK = 65536
PR_SET_PDEATHSIG = 1
SIGKILL = 9


def split_address(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not host:port: {text!r}")
    return host.strip("[]"), int(port)


def pump(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until both sides have finished sending; then close both.

    A side that ends its output (EOF) is passed on as a half-close, so request/response
    protocols that close their sending side first still get their answer."""
    open_ = {a: b, b: a}
    try:
        while open_:
            ready, _, _ = select.select(list(open_), [], [])
            for src in ready:
                dst = open_[src]
                try:
                    data = src.recv(CHUNK)
                except OSError:
                    data = b""
                if data:
                    dst.sendall(data)
                    continue
                del open_[src]
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    open_.clear()  # the other side is gone too
    except OSError:
        pass
    finally:
        a.close()
        b.close()


def _relay(client: socket.socket, path: str, slots: threading.BoundedSemaphore) -> None:
    try:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(path)
        except OSError:
            upstream.close()
            client.close()
            return
        pump(client, upstream)
    finally:
        slots.release()


def serve(listeners: dict[socket.socket, str]) -> None:
    """Accept on every listener; relay each connection to its unix socket, in its own thread."""
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
    while True:
        ready, _, _ = select.select(list(listeners), [], [])
        for listener in ready:
            try:
                client, _ = listener.accept()
            except OSError:
                continue
            if not slots.acquire(blocking=False):
                client.close()
                continue
            threading.Thread(target=_relay, args=(client, listeners[listener], slots), daemon=True).start()


def parse(argv: list[str]) -> tuple[list[tuple[str, int, str]], list[str]]:
    """(routes as (host, port, socket path), the server's argv) from this script's arguments."""
    routes: list[tuple[str, int, str]] = []
    rest = list(argv)
    while rest and rest[0] == "--route":
        address, sep, path = rest[1].partition("=") if len(rest) > 1 else ("", "", "")
        if not sep:
            raise ValueError("--route needs HOST:PORT=SOCKET")
        routes.append((*split_address(address), path))
        rest = rest[2:]
    if not rest or rest[0] != "--" or len(rest) < 2:
        raise ValueError("usage: egress_relay.py [--route HOST:PORT=SOCKET]... -- COMMAND...")
    return routes, rest[1:]


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(16)
    return sock


def _die_with_parent(parent: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, SIGKILL)
    if os.getppid() != parent:  # the server was already gone before the signal was armed
        os._exit(0)


def main(argv: list[str]) -> None:
    routes, command = parse(argv)
    listeners = {_listen(host, port): path for host, port, path in routes}
    parent = os.getpid()
    if os.fork() == 0:
        _die_with_parent(parent)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)  # never hold the server's MCP pipe open
        try:
            serve(listeners)
        finally:
            os._exit(0)
    for listener in listeners:
        listener.close()
    os.execvp(command[0], command)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (OSError, ValueError) as exc:
        print(f"egress relay: {exc}", file=sys.stderr)
        sys.exit(126)
