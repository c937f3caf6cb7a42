"""Reading a witness log: the API tests count side effects with.

    witness = WitnessLog(path)               # stack.witness on every test stack
    witness.count(key=envelope.idempotency_key)          # tools/call requests the server received
    witness.count(tool="issue_refund", server="sor")     # by tool, on the write identity
    [c.is_error for c in witness.calls(key=k)]           # how the server answered each one
    start = witness.mark(); ...; witness.count(since=start)   # only what happened after the mark
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Call:
    """One ``tools/call`` request the witness forwarded, with what came back for it."""

    server: str
    transport: str
    conn: str
    id: Any
    tool: str | None
    arguments_sha256: str
    idempotency_key: str | None
    action_id: str | None
    fencing_token: int | None
    at: float
    #: The ``result`` record (``is_error``, ``rpc_error``) once the server answered; None before.
    result: dict[str, Any] | None = None
    cancelled: bool = False
    progress: int = 0
    #: The approved plan's hash the call carried (``proofline/plan_hash``), when it was approved by plan.
    plan_hash: str | None = None

    @property
    def answered(self) -> bool:
        return self.result is not None

    @property
    def is_error(self) -> bool | None:
        """True/False from the result's ``isError``; None when unanswered or a JSON-RPC error."""
        return None if self.result is None else self.result.get("is_error")

    @property
    def rpc_error(self) -> int | None:
        return None if self.result is None else self.result.get("rpc_error")


CALL_FIELDS = ("server", "transport", "conn", "id", "tool", "arguments_sha256", "idempotency_key", "action_id",
               "fencing_token", "at")


class WitnessLog:
    """The JSONL log one or more witness relays append to. Every read re-reads the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def mark(self) -> int:
        """A position in the log; pass it as ``since`` to see only later records."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def records(self, kind: str | None = None, since: int = 0) -> list[dict[str, Any]]:
        """Every complete record (a line still being written is left out), oldest first."""
        try:
            with self.path.open("rb") as f:
                f.seek(since)
                data = f.read()
        except FileNotFoundError:
            return []
        out = []
        for line in data.split(b"\n")[:-1]:
            record = json.loads(line)
            if kind is None or record.get("kind") == kind:
                out.append(record)
        return out

    def calls(self, tool: str | None = None, key: str | None = None, server: str | None = None,
              action: str | None = None, since: int = 0) -> list[Call]:
        """The ``tools/call`` requests forwarded to a server, filtered, with their answers."""
        calls: dict[tuple[str, Any], Call] = {}
        for record in self.records(since=since):
            ident = (record.get("conn"), json.dumps(record.get("id")))
            kind = record.get("kind")
            if kind == "call":
                calls[ident] = Call(**{f: record.get(f) for f in CALL_FIELDS}, plan_hash=record.get("plan_hash"))
            elif ident in calls and kind == "result":
                calls[ident] = replace(calls[ident], result=record)
            elif ident in calls and kind == "cancel":
                calls[ident] = replace(calls[ident], cancelled=True)
            elif ident in calls and kind == "progress":
                calls[ident] = replace(calls[ident], progress=calls[ident].progress + 1)
        return [c for c in calls.values()
                if (tool is None or c.tool == tool) and (key is None or c.idempotency_key == key)
                and (server is None or c.server == server) and (action is None or c.action_id == action)]

    def count(self, tool: str | None = None, key: str | None = None, server: str | None = None,
              action: str | None = None, since: int = 0) -> int:
        """How many ``tools/call`` requests matching the filters the server was handed."""
        return len(self.calls(tool, key, server, action, since))

    def responses(self, tool: str | None = None, key: str | None = None, server: str | None = None,
                  action: str | None = None, since: int = 0) -> list[dict[str, Any]]:
        """The answers the server sent to matching calls (``is_error`` / ``rpc_error``), in order."""
        return [c.result for c in self.calls(tool, key, server, action, since) if c.result is not None]

    def requests(self, method: str | None = None, server: str | None = None, since: int = 0) -> list[dict[str, Any]]:
        """Requests other than ``tools/call`` the server was handed (``method``, ``server``, ``at``)."""
        return [r for r in self.records("request", since)
                if (method is None or r.get("method") == method) and (server is None or r.get("server") == server)]

    def cancels(self, key: str | None = None, since: int = 0) -> list[dict[str, Any]]:
        """``notifications/cancelled`` the client sent (matched to its call when the witness saw it)."""
        return [r for r in self.records("cancel", since) if key is None or r.get("idempotency_key") == key]
