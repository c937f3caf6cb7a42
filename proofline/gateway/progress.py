"""The action's stages as MCP progress: ``notifications/progress`` for a call that asked for them.

When a ``tools/call`` carries ``_meta.progressToken``, the gateway follows the action in the ledger
instead of waiting on the settlement notice: it reads the events appended since the last read
(one indexed read of the chain per :data:`POLL_SECONDS`) and sends one notification per event, its
``message`` the event's name (``published``, ``claimed``, ``tool_called``, ``verification`` ...)
and its ``progress`` the event's position in the chain, which only grows. ``total`` is never sent:
how many events an action will have is not known before it settles. At most :data:`LIMIT`
notifications are sent per call (an action that loops through recovery is still answered, its
later stages not streamed); the answer itself is the proven outcome, as without progress.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from proofline.client import ActionResult

#: How often the ledger is read while an action is followed.
POLL_SECONDS = 0.2
#: The most progress notifications one call sends.
LIMIT = 64
#: The most events one read of the chain returns.
BATCH = 100


def progress_token(params: Any) -> str | int | None:
    """The token a ``tools/call`` asked progress for, or None (the SDK gives ``_meta`` as a dict
    keyed by field name)."""
    meta = getattr(params, "meta", None)
    token = meta.get("progress_token", meta.get("progressToken")) if isinstance(meta, dict) else None
    return token if isinstance(token, str | int) and not isinstance(token, bool) else None


async def follow(read: Callable[[int], tuple[ActionResult, list[dict[str, Any]]]],
                 report: Callable[[float, str], Awaitable[None]], seconds: float) -> ActionResult:
    """Report each new ledger event until the action is settled or proposed, or ``seconds`` passed;
    the action's state then. ``read(after_seq)`` gives the state, then up to :data:`BATCH` events
    after ``after_seq``: read in that order, a settled state's own events are always among them."""
    deadline = time.monotonic() + seconds
    seen, sent = 0, 0
    while True:
        result, events = await anyio.to_thread.run_sync(read, seen)
        for event in events:
            seen = max(seen, int(event["seq"]))
            if sent < LIMIT:
                await report(float(event["seq"]), str(event["event"]))
                sent += 1
        if result.settled or result.proposed:
            if len(events) < BATCH:  # the chain up to the settlement has been streamed
                return result
            continue
        if time.monotonic() >= deadline:
            return result
        await anyio.sleep(POLL_SECONDS)
