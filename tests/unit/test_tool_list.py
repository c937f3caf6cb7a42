"""The tool-list cache's rules (worker/tool_list.py), on a counting list function."""

from __future__ import annotations

import anyio
import pytest
from mcp.types import ToolListChangedNotification

from worker import tool_list
from worker.tool_list import ToolListCache


class Server:
    def __init__(self) -> None:
        self.lists = 0
        self.connections: frozenset[object] | None = frozenset({"c1"})

    async def list_tools(self) -> dict[str, str]:
        self.lists += 1
        return {"create_ticket": f"hash-{self.lists}"}


def lookup(cache: ToolListCache, server: Server, max_age: float = 60.0) -> dict[str, str]:
    return anyio.run(cache.get, server.list_tools, max_age, lambda: server.connections)


def test_listed_once_then_served_from_the_cache() -> None:
    cache, server = ToolListCache(), Server()
    assert lookup(cache, server) == {"create_ticket": "hash-1"} and cache.last_miss == tool_list.EMPTY
    assert lookup(cache, server) == {"create_ticket": "hash-1"} and cache.last_miss is None
    assert server.lists == 1


def test_list_changed_makes_it_stale() -> None:
    cache, server = ToolListCache(), Server()
    lookup(cache, server)
    anyio.run(cache.notify, ToolListChangedNotification())
    assert lookup(cache, server) == {"create_ticket": "hash-2"} and cache.last_miss == tool_list.CHANGED
    assert lookup(cache, server) == {"create_ticket": "hash-2"} and cache.last_miss is None


@pytest.mark.parametrize("now", [frozenset(), frozenset({"c2"}), frozenset({"c1", "c2"})])
def test_other_connections_make_it_stale(now: frozenset[object]) -> None:
    cache, server = ToolListCache(), Server()
    lookup(cache, server)
    server.connections = now
    lookup(cache, server)
    assert cache.last_miss == tool_list.CONNECTION and server.lists == 2


def test_the_maximum_age(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(tool_list.time, "monotonic", lambda: clock[0])
    cache, server = ToolListCache(), Server()
    lookup(cache, server, max_age=30)
    clock[0] += 29.9
    lookup(cache, server, max_age=30)
    assert cache.last_miss is None
    clock[0] += 0.2
    lookup(cache, server, max_age=30)
    assert cache.last_miss == tool_list.AGED and server.lists == 2
    lookup(cache, server, max_age=0)
    assert cache.last_miss == tool_list.AGED and server.lists == 3
