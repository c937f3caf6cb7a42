"""The console's input hygiene: what reaches a page or the database is text Postgres can hold.

A request whose path, query or form carries a NUL byte or another control character, a
percent-escape that is not one (``%zz``) or that decodes to bytes that are not UTF-8, or an id
longer than any the ledger holds, is answered 400 with the console's own refusal page
(``console_input_invalid``) before any route runs. A ``psycopg`` ``DataError`` that gets past this
(a value Postgres still cannot take) is answered the same way at the application's boundary
(:func:`data_error_page`), never as a 500 or a reset connection.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote_to_bytes

from proofline.errors import ConsoleInputInvalid

#: The longest path a console route has: an id of 200 characters (the envelope's limit) and its verb.
MAX_PATH = 320
#: Query and form fields that name one thing (an id, a status, a scope): the envelope's id limit.
ID_FIELDS = frozenset({"action_id", "run_id", "tenant", "action_type", "status", "outcome", "resolution", "scope",
                       "value", "identity", "user", "minutes", "limit", "since", "until", "approver"})
MAX_ID = 200
#: Any other field (a reason, evidence as JSON, a page cursor, a token).
MAX_FIELD = 16_384
#: A whole form body, read before any route sees it.
MAX_BODY = 256 * 1024

_BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")
#: C0 controls and DEL; a free-text form field may hold tab, newline and carriage return.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_TEXT = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[..., Awaitable[None]]],
                   Awaitable[None]]


def _decoded(raw: bytes, where: str, plus: bool = False) -> str:
    if _BAD_ESCAPE.search(raw):
        raise ConsoleInputInvalid(f"the {where} has a '%' that is not followed by two hex digits")
    try:
        return unquote_to_bytes(raw.replace(b"+", b" ") if plus else raw).decode("utf-8")
    except UnicodeDecodeError:
        raise ConsoleInputInvalid(f"the {where} is not UTF-8 once its %-escapes are decoded") from None


def check_path(raw: bytes) -> None:
    """Refuse a request path the console cannot use (``console_input_invalid``)."""
    path = _decoded(raw, "path")
    if _CONTROL.search(path):
        raise ConsoleInputInvalid("the path holds a NUL byte or another control character")
    longest = max(len(part) for part in path.split("/"))
    if longest > MAX_ID:
        raise ConsoleInputInvalid(f"the path has a part of {longest} characters; an id is at most {MAX_ID}")
    if len(path) > MAX_PATH:
        raise ConsoleInputInvalid(f"the path is {len(path)} characters long; no console page has one over {MAX_PATH}"
                                  f" (an id is at most {MAX_ID})")


def check_fields(raw: bytes, where: str) -> None:
    """Refuse a query string or an urlencoded form whose names or values the console cannot use."""
    if len(raw) > MAX_BODY:
        raise ConsoleInputInvalid(f"the {where} is over {MAX_BODY} bytes")
    for pair in raw.split(b"&"):
        if not pair:
            continue
        name_raw, _, value_raw = pair.partition(b"=")
        name, value = _decoded(name_raw, where, plus=True), _decoded(value_raw, where, plus=True)
        if _CONTROL.search(name) or len(name) > 64:
            raise ConsoleInputInvalid(f"the {where} has a field name the console does not use")
        control = _CONTROL_TEXT if where == "form" and name not in ID_FIELDS else _CONTROL
        if control.search(value):
            raise ConsoleInputInvalid(f"the {where} field {name!r} holds a NUL byte or another control character")
        limit = MAX_ID if name in ID_FIELDS else MAX_FIELD
        if len(value) > limit:
            raise ConsoleInputInvalid(f"the {where} field {name!r} is {len(value)} characters long; at most {limit}")


class InputHygiene:
    """ASGI middleware: checks path, query and (urlencoded) form before the application runs, and
    answers a refusal with ``refuse(scope, error)``, the console's 400 page."""

    def __init__(self, app: ASGIApp, refuse: Callable[[dict[str, Any], ConsoleInputInvalid], Any]) -> None:
        self.app, self.refuse = app, refuse

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            check_path(scope.get("raw_path") or scope["path"].encode())
            check_fields(scope.get("query_string") or b"", "query")
            receive = await self._checked_body(scope, receive)
        except ConsoleInputInvalid as exc:
            response = self.refuse(scope, exc)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _checked_body(self, scope: dict[str, Any], receive: Any) -> Any:
        """The body of a form post, read and checked, and a ``receive`` that replays it."""
        if scope["method"] in ("GET", "HEAD"):
            return receive
        headers = dict(scope.get("headers") or [])
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if kind == b"multipart/form-data":
            raise ConsoleInputInvalid("the console's forms are sent urlencoded, never as multipart")
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _replay(b"", receive, disconnected=True)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY:
                raise ConsoleInputInvalid(f"the form is over {MAX_BODY} bytes")
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if kind == b"application/x-www-form-urlencoded":
            check_fields(body, "form")
        return _replay(body, receive)


def _replay(body: bytes, receive: Any, disconnected: bool = False) -> Callable[[], Awaitable[dict[str, Any]]]:
    """The body once, then the server's own ``receive`` (which waits for the client to go away)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if disconnected:
            return {"type": "http.disconnect"}
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
