"""The JSON-RPC request ids of the MCP requests a call sent, for the ledger.

A request id is only a per-connection counter (the SDK's dispatcher mints 1, 2, 3, ... on each
connection), so it is recorded together with the session it was minted on: ``mcp_connection`` is
an id this worker gives each MCP session (connection) it opens, never reused. (Not ``mcp_session``:
the redaction policy treats a field named ``session`` as a secret.) Neither is ever a key; together
they let an auditor find the exact request in a server's own logs.

Reading the counter costs two attribute lookups before and after a call; no message is parsed.
Calls on one session never overlap (each worker process runs one task at a time and a session's
requests are awaited one by one), so the ids minted between the two readings are the call's own.
"""

from __future__ import annotations

import uuid
from typing import Any


def new_session_id() -> str:
    return uuid.uuid4().hex[:16]


def counter(client: Any) -> int | None:
    """The connection's request-id counter now (the last id minted), or None when the client has
    no JSON-RPC connection (an in-process server, a closed session)."""
    try:
        session = client.session
    except RuntimeError:
        return None
    value = getattr(getattr(session, "_dispatcher", None), "_next_id", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def minted(session_id: str, before: int | None, after: int | None) -> dict[str, Any]:
    """What a call's evidence records: the session, the id of its first request (the ``tools/call``)
    and, when the call sent more than one (a re-sent call, a re-listed tool), how many."""
    out: dict[str, Any] = {"mcp_connection": session_id}
    if before is None or after is None or after <= before:
        return out
    out["mcp_request_id"] = before + 1
    if after - before > 1:
        out["mcp_requests"] = after - before
    return out
