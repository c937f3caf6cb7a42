"""The ``server_requests``, ``ask_roots`` and ``ask_elicitation`` faults: the write tool asks its
client for things mid-call.

``server_requests`` asks for the client's roots, an elicited answer and a sampled message, as a
server that wants a human or a model in the loop would; ``ask_roots`` asks for the roots only, and
``ask_elicitation`` for the elicited answer only. On
the 2025-11-25 protocol each is a request on the session; on 2026-07-28, which has no back-channel,
the tool answers its first round with an ``InputRequiredResult`` carrying the same requests, and the
client either answers and calls again, or refuses. What the client answered is appended, one JSON
line per request (and first the capabilities the client announced), to ``<database>.asks.jsonl``,
so a test sees the server's side as well.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import Context
from mcp.shared.exceptions import MCPError, NoBackChannelError
from mcp.types import (
    CreateMessageRequest,
    CreateMessageRequestParams,
    ElicitRequest,
    ElicitRequestFormParams,
    InputRequiredResult,
    ListRootsRequest,
    SamplingMessage,
    TextContent,
)

QUESTION = "Approve closing the other tickets of this owner too?"
PROMPT = "Summarise the customer's last three messages."
_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"approve": {"type": "boolean"}}, "required": ["approve"]}


def asks_path(db_path: str) -> Path:
    return Path(f"{db_path}.asks.jsonl")


def _note(db_path: str, method: str, answer: Any) -> None:
    with asks_path(db_path).open("a") as f:
        f.write(json.dumps({"method": method, "answer": answer}, default=str) + "\n")


def _messages() -> list[SamplingMessage]:
    return [SamplingMessage(role="user", content=TextContent(type="text", text=PROMPT))]


#: The one method each single-request fault asks for (``server_requests`` asks for all three).
ONLY = {"ask_roots": "roots/list", "ask_elicitation": "elicitation/create"}


async def ask_client(ctx: Context, db_path: str, only: str | None) -> InputRequiredResult | None:
    """Put this fault's requests to the client (``only`` one method, or all); an
    ``InputRequiredResult`` to return when the connection has no back-channel and the client has not
    answered yet, else None (go on)."""
    responses = ctx.input_responses
    if responses is not None:
        for key, response in responses.items():
            _note(db_path, key, response.model_dump(mode="json", by_alias=True, exclude_none=True))
        return None
    caps = ctx.session.client_capabilities
    _note(db_path, "capabilities", caps.model_dump(mode="json", by_alias=True, exclude_none=True) if caps else None)
    asks: list[tuple[str, Any]] = [
        ("roots/list", lambda: ctx.session.list_roots()),
        ("elicitation/create", lambda: ctx.session.elicit(QUESTION, _SCHEMA, related_request_id=ctx.request_id)),
        ("sampling/createMessage", lambda: ctx.session.create_message(_messages(), max_tokens=64,
                                                                     related_request_id=ctx.request_id))]
    for method, ask in asks:
        if only is not None and method != only:
            continue
        try:
            answer = await ask()
        except NoBackChannelError:
            return _embedded(only)
        except MCPError as exc:
            _note(db_path, method, {"error": exc.error.code, "message": exc.error.message})
        else:
            _note(db_path, method, answer.model_dump(mode="json", by_alias=True, exclude_none=True))
    return None


def _embedded(only: str | None) -> InputRequiredResult:
    requests: dict[str, Any] = {
        "roots/list": ListRootsRequest(),
        "elicitation/create": ElicitRequest(params=ElicitRequestFormParams(message=QUESTION, requested_schema=_SCHEMA)),
        "sampling/createMessage": CreateMessageRequest(params=CreateMessageRequestParams(messages=_messages(),
                                                                                         max_tokens=64))}
    if only is not None:
        requests = {only: requests[only]}
    return InputRequiredResult(input_requests=requests, request_state="asked")
