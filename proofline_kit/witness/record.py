"""What the witness writes: one JSON line per observed JSON-RPC message of interest.

The witness never interprets a call's outcome beyond the wire: it records that a ``tools/call``
request went to the server (``call``), that the server answered it (``result``, with ``isError``
or the JSON-RPC error code), that the client cancelled it (``cancel``), that the server sent
progress for it (``progress``); any other request (``tools/list``, discovery, the handshake) is
one ``request`` record with its method, so requests per action can be counted on the wire. A request the relay could not hand to the server is never
recorded: the HTTP relay connects upstream before it reads a byte of the request, and the stdio
relay stops recording once the server's stdin is closed. Every record is one ``write(2)`` on a file opened with ``O_APPEND``, so several
witness processes (one per worker session) can share one log and a reader never sees half a line
from a finished write.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import rfc8785

#: Where the runtime puts the idempotency key, the action id and the fencing token: the request's
#: ``_meta`` (worker/calls.py sends them there; arguments stay exactly what the contract names).
KEY_META = "proofline/idempotency_key"
ACTION_META = "proofline/action_id"
FENCING_META = "proofline/fencing_token"
PLAN_META = "proofline/plan_hash"

KINDS = ("call", "result", "cancel", "progress", "request")


def arguments_sha256(arguments: Any) -> str:
    """sha256 of the RFC 8785 canonical JSON of the arguments: the same digest the envelope's
    ``arguments_hash`` holds, so a test can compare what was approved with what was sent."""
    return hashlib.sha256(rfc8785.dumps(arguments if arguments is not None else {})).hexdigest()


def new_connection_id(transport: str) -> str:
    """JSON-RPC ids are per connection; a record's ``conn`` keeps them apart across sessions."""
    return f"{transport}-{uuid.uuid4().hex[:12]}"


class RecordWriter:
    """Appends records to the log; flushed per record (no user-space buffer at all)."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({**record, "at": time.time()}, sort_keys=True, default=str) + "\n"
        os.write(self._fd, line.encode())

    def close(self) -> None:
        os.close(self._fd)


class Observer:
    """Turns the JSON-RPC messages of one connection into records.

    ``client`` is called with each message the client sent (before it is forwarded), ``server``
    with each message the server sent (before it is forwarded back)."""

    def __init__(self, writer: RecordWriter, server: str, transport: str, open_calls: OpenCalls | None = None) -> None:
        self.writer = writer
        self.base = {"server": server, "transport": transport, "conn": new_connection_id(transport)}
        #: Open ``tools/call`` requests of this connection, by JSON-RPC id.
        self.pending: dict[Any, dict[str, Any]] = {}
        self.tokens: dict[Any, dict[str, Any]] = {}
        #: Open calls of every connection of the relay: over HTTP a cancel may come on another one.
        self.open_calls = open_calls if open_calls is not None else OpenCalls()
        #: The session the current message belongs to (HTTP: the ``mcp-session-id`` header).
        self.session: str | None = None

    def _emit(self, kind: str, call: dict[str, Any], **extra: Any) -> None:
        fields = {k: v for k, v in call.items() if not k.startswith("_")}
        self.writer.write({**self.base, "kind": kind, **fields, **extra})

    def client(self, message: Any) -> None:
        for item in message if isinstance(message, list) else [message]:
            if not isinstance(item, dict):
                continue
            method, params = item.get("method"), item.get("params")
            params = params if isinstance(params, dict) else {}
            if method == "tools/call" and "id" in item:
                self._call(item["id"], params)
            elif isinstance(method, str) and "id" in item:
                # Every other request (tools/list, discovery, the handshake) is counted, not followed.
                self.writer.write({**self.base, "kind": "request", "method": method[:100], "id": item["id"]})
            elif method == "notifications/cancelled":
                rid = params.get("requestId")
                call = self.pending.get(rid) or self.open_calls.only(self.session, rid)
                self._emit("cancel", call or {"id": rid, "matched": False}, reason=params.get("reason"),
                           via="notification")

    def _call(self, rpc_id: Any, params: dict[str, Any]) -> None:
        meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
        call = {"id": rpc_id, "tool": params.get("name"), "arguments_sha256": arguments_sha256(params.get("arguments")),
                "idempotency_key": meta.get(KEY_META), "action_id": meta.get(ACTION_META),
                "fencing_token": meta.get(FENCING_META), "plan_hash": meta.get(PLAN_META), "conn": self.base["conn"]}
        self.pending[rpc_id] = call
        self.open_calls.add(self.session, rpc_id, call)
        if "progressToken" in meta:
            self.tokens[meta["progressToken"]] = call
        self._emit("call", call)

    def client_closed(self) -> None:
        """The client closed its side with calls unanswered: over streamable HTTP that is how a
        client gives up on a request (the server sees the disconnect), recorded as a cancel."""
        for call in self.pending.values():
            self._emit("cancel", call, reason="client closed the connection", via="disconnect")

    def close(self) -> None:
        """The connection is gone: its unanswered calls can no longer be cancelled through it."""
        for call in self.pending.values():
            self.open_calls.remove(call)
        self.pending.clear()

    def server(self, message: Any) -> None:
        for item in message if isinstance(message, list) else [message]:
            if not isinstance(item, dict):
                continue
            if item.get("method") == "notifications/progress":
                params = item.get("params") if isinstance(item.get("params"), dict) else {}
                call = self.tokens.get(params.get("progressToken"))
                if call is not None:
                    self._emit("progress", call, progress=params.get("progress"))
                continue
            if "id" not in item or not ("result" in item or "error" in item) or item["id"] not in self.pending:
                continue
            call = self.pending.pop(item["id"])
            self.open_calls.remove(call)
            result = item.get("result") if isinstance(item.get("result"), dict) else {}
            error = item.get("error") if isinstance(item.get("error"), dict) else None
            self._emit("result", call, is_error=bool(result.get("isError")) if error is None else None,
                       rpc_error=error.get("code") if error else None)


class OpenCalls:
    """Unanswered calls of all connections, by (session, JSON-RPC id). Ids are only unique per
    client, so a cancel is attributed to a call of another connection only when exactly one open
    call has its session and id; otherwise it is recorded unmatched."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str | None, str], list[dict[str, Any]]] = {}

    @staticmethod
    def _key(session: str | None, rpc_id: Any) -> tuple[str | None, str]:
        return session, json.dumps(rpc_id)

    def add(self, session: str | None, rpc_id: Any, call: dict[str, Any]) -> None:
        call["_open"] = self._key(session, rpc_id)
        self.calls.setdefault(call["_open"], []).append(call)

    def remove(self, call: dict[str, Any]) -> None:
        found = [c for c in self.calls.get(call["_open"], []) if c is not call]
        if found:
            self.calls[call["_open"]] = found
        else:
            self.calls.pop(call["_open"], None)

    def only(self, session: str | None, rpc_id: Any) -> dict[str, Any] | None:
        found = self.calls.get(self._key(session, rpc_id), [])
        return found[0] if len(found) == 1 else None


def parse(payload: bytes | str) -> Any:
    """A JSON-RPC message (or batch), or None when the bytes are not JSON."""
    try:
        return json.loads(payload)
    except ValueError:
        return None


class LineSplitter:
    """Newline-delimited messages (the stdio transport), bounded: a line longer than ``limit``
    bytes is skipped, not buffered (the relay still forwards its bytes unchanged)."""

    def __init__(self, limit: int = 16 * 1024 * 1024) -> None:
        self.limit = limit
        self.buffer = bytearray()
        self.skipping = False

    def feed(self, chunk: bytes) -> list[bytes]:
        lines: list[bytes] = []
        while chunk:
            head, newline, chunk = chunk.partition(b"\n")
            if not self.skipping:
                self.buffer += head
                if len(self.buffer) > self.limit:
                    self.buffer.clear()
                    self.skipping = True
            if newline:
                if not self.skipping and self.buffer.strip():
                    lines.append(bytes(self.buffer))
                self.buffer.clear()
                self.skipping = False
            else:
                break
        return lines
