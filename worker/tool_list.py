"""The tool list of one MCP session, cached for the contract check of each action.

Revalidation compares the approved tool contract hash with what the server lists now. Listing on
every action costs one request per action; the list is kept per session instead and listed again
when any of these says it may have changed:

- the server sent ``notifications/tools/list_changed`` (on any stream of the session);
- the session is new: a reconnected session starts with an empty cache, so a stdio server that was
  restarted (a new process, a new session) is always listed again;
- over HTTP, the connections the list came over are no longer the ones in use: a server restart
  closes them (the worker sees end-of-file on an idle keep-alive connection), and a request that
  needed a new connection replaces them. A proxy that keeps client connections open while the
  server behind it restarts hides this; the maximum age bounds how long;
- the list is older than the maximum age (``tool_list_max_age_seconds`` in the servers file for
  one server, else the setting ``PROOFLINE_TOOL_LIST_MAX_AGE_SECONDS``; 0 lists on every action).

A cached list only ever lets an action go on: when it disagrees with the approved contract, the
worker lists again before refusing (``worker/execute.py``), since the session it came from may
belong to a server that has since exited or restarted, which the worker notices only at the
session's next request.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from mcp.types import ToolListChangedNotification

#: Why a cached list was not used (kept on the session for the ledger evidence and tests).
EMPTY, CHANGED, CONNECTION, AGED = "empty", "list_changed", "connection_changed", "max_age"


@dataclass
class ToolListCache:
    """One session's last tool list: its contract hashes, when it was listed, and over what."""

    hashes: dict[str, str] | None = None
    listed_at: float = 0.0
    #: The HTTP connections the list came over (None for stdio: the session is the process).
    connections: frozenset[Any] | None = None
    #: Why the last lookup listed again (None: served from the cache).
    last_miss: str | None = EMPTY
    lists: int = 0
    hits: int = 0
    _changed: bool = field(default=False, repr=False)

    async def notify(self, message: Any) -> None:
        """The session's message handler: a changed list makes the cache stale."""
        if isinstance(message, ToolListChangedNotification):
            self._changed = True
        await anyio.lowlevel.checkpoint()

    def stale(self, max_age: float, connections: frozenset[Any] | None, now: float) -> str | None:
        """Why the cached list may not be used now, or None when it may."""
        if self.hashes is None:
            return EMPTY
        if self._changed:
            return CHANGED
        if max_age <= 0 or now - self.listed_at >= max_age:
            return AGED
        if self.connections is not None and (not connections or not connections <= self.connections):
            return CONNECTION
        return None

    async def get(self, list_tools: Callable[[], Awaitable[dict[str, str]]], max_age: float,
                  connections: Callable[[], frozenset[Any] | None]) -> dict[str, str]:
        """The tool contract hashes: cached when still valid, else listed now (and kept)."""
        self.last_miss = self.stale(max_age, connections(), time.monotonic())
        if self.last_miss is None:
            self.hits += 1
            return dict(self.hashes or {})
        # Cleared before the request: a notification that arrives while listing marks the new list stale.
        self._changed = False
        listed_at = time.monotonic()
        hashes = await list_tools()
        self.hashes, self.listed_at, self.connections = hashes, listed_at, connections()
        self.lists += 1
        return dict(hashes)
