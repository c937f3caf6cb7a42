"""A streamable-HTTP MCP server that refuses requests without a known bearer token.

``python credentialed_server.py PORT TOKENS_JSON [CERT KEY CA]``: TOKENS_JSON maps an
``Authorization`` header value to an identity name. With CERT/KEY/CA it serves HTTPS and requires
a client certificate signed by CA (mutual TLS). The tool ``seen`` reports how many requests each
identity has made, so a test can tell which credentials a client really sent.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer

from proofline.listen import listening_socket

SEEN: Counter[str] = Counter()
server = MCPServer("credentialed", version="1.0.0")


@server.tool()
def seen() -> dict[str, Any]:
    """Requests accepted so far, by identity."""
    return {"seen": dict(SEEN)}


class RequireToken:
    """ASGI middleware: 401 unless the Authorization header is one of the known tokens."""

    def __init__(self, app: Any, tokens: dict[str, str]) -> None:
        self.app, self.tokens = app, tokens

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            who = self.tokens.get(headers.get(b"authorization", b"").decode())
            if who is None:
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"credentials required"})
                return
            SEEN[who] += 1
        await self.app(scope, receive, send)


def main(argv: list[str]) -> None:
    """argv: PORT_FILE TOKENS_JSON [CERT KEY CA]. Binds a loopback port of its own choosing (port 0)
    and writes the number to PORT_FILE once it listens."""
    port_file, tokens = Path(argv[0]), json.loads(argv[1])
    app = RequireToken(server.streamable_http_app(stateless_http=True, json_response=True), tokens)
    tls: dict[str, Any] = {}
    if len(argv) > 2:
        tls = {"ssl_certfile": argv[2], "ssl_keyfile": argv[3], "ssl_ca_certs": argv[4],
               "ssl_cert_reqs": ssl.CERT_REQUIRED}
    sock = listening_socket("127.0.0.1", 0)
    tmp = port_file.with_name(port_file.name + ".tmp")
    tmp.write_text(str(sock.getsockname()[1]))
    os.replace(tmp, port_file)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", **tls)).run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1:])
