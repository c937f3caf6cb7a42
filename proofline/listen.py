"""Listening sockets for the HTTP servers Proofline and its kit start on a socket of their own
(``--port 0``: the port is known, and can be written to a file, before the first request).

asyncio turns Nagle's algorithm off on an accepted connection only when the listening socket says
its protocol is TCP (``sock.proto == IPPROTO_TCP``); a socket made with ``socket.socket(AF_INET,
SOCK_STREAM)`` or ``socket.create_server`` says 0, so every response written in more than one
piece (headers, then body or event-stream chunks) waits for the client's delayed ACK: about 40 ms
per request on Linux loopback, measured here against 5 ms with it off."""

from __future__ import annotations

import socket


def listening_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: any free one) and listening, with Nagle's
    algorithm off on it and on every connection it accepts; inheritable (uvicorn may fork)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
