"""The wire format of every task message: a kombu serializer of our own, the only content the
workers accept.

Its decoder runs inside the Celery consumer (``message.payload``) before anything else looks at
the body, so it is written to be total: whatever arrives, it returns a well-formed Celery protocol 2
body ``(args, kwargs, embed)``. A body that is too large, nested too deep, not UTF-8, not JSON or
not of the protocol's shape becomes a :class:`RefusedBody` placeholder (reason, bounded excerpt,
digest) that the task records as a refusal. Nesting depth is checked by a flat scan before the
JSON parser runs, so no input reaches a recursive parser, ``repr`` or ``pickle`` deeper than
:data:`MAX_DEPTH` (a 940-deep list used to kill the consumer while pickling the job for the pool).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from kombu.serialization import register

NAME = "proofline"
CONTENT_TYPE = "application/x-proofline+json"
#: Larger than the largest message validation admits (worker/validate.py MAX_MESSAGE_BYTES) plus
#: Celery's framing, so publish-time validation and the wire never disagree.
MAX_BODY_BYTES = 256 * 1024 + 16 * 1024
#: Envelopes nest a handful of levels; arguments may nest more, but nothing legitimate nears this.
MAX_DEPTH = 64
EXCERPT_CHARS = 200
#: Marks a body standing in for a broker document kombu could not read (worker/transport.py);
#: never valid JSON (NUL first), so it can only ever be refused.
QUARANTINE_PREFIX = b"\x00proofline:unreadable-broker-document:"
#: Marks a body standing in for a broker document too large to read at all: the prefix, then
#: ``<size>:<sha256>:`` of the whole document, then its first bytes (worker/transport.py).
OVERSIZE_PREFIX = b"\x00proofline:oversize-broker-document:"

# Strings are consumed whole (escapes included), so brackets inside them are not counted.
_TOKENS = re.compile(r'"(?:[^"\\]++|\\.)*+"|[\[\]{}]', re.S)


@dataclass(frozen=True)
class RefusedBody:
    """What an unacceptable body is replaced with. Small, flat and picklable: it travels to the pool
    process instead of the body, and the task records it as ``envelope_refused``."""

    reason: str
    detail: str
    digest: str
    size: int
    excerpt: str

    def evidence(self) -> dict[str, Any]:
        return {"reason_code": self.reason, "detail": self.detail, "message_digest": self.digest,
                "message_bytes": self.size, "excerpt": self.excerpt}


def excerpt(data: bytes | str, limit: int = EXCERPT_CHARS) -> str:
    """A bounded, printable, JSON- and Postgres-safe excerpt of raw input."""
    raw = data[: limit * 4] if isinstance(data, bytes | bytearray) else str(data)[: limit * 4].encode(
        "utf-8", "backslashreplace")
    text = bytes(raw).decode("utf-8", "backslashreplace").replace("\x00", "\\x00")
    return text[:limit]


def digest(data: bytes | str) -> str:
    raw = data if isinstance(data, bytes | bytearray) else str(data).encode("utf-8", "surrogatepass")
    return hashlib.sha256(bytes(raw)).hexdigest()


def refused(reason: str, detail: str, data: bytes | str) -> RefusedBody:
    size = len(data)
    return RefusedBody(reason, detail[:300], digest(data), size, excerpt(data))


def max_depth(text: str, limit: int) -> int:
    """Nesting depth of JSON text by a flat scan; stops counting once past ``limit``."""
    depth = deepest = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif token in "]}":
            depth -= 1
    return deepest


#: The only ``embed`` keys Celery reads; callbacks and chains are never part of a Proofline message,
#: so a body that carries them cannot make the worker start other tasks.
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def loads(data: bytes | str) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """Decode a task body; never raises for any input (placeholders instead)."""
    try:
        return _loads(data)
    except Exception as exc:  # noqa: BLE001 - the consumer must never see an exception from a body
        return [refused("message_undecodable", f"{type(exc).__name__}", data if isinstance(
            data, bytes | str) else repr(type(data)))], {}, dict(_EMBED)


def _loads(data: bytes | str) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    if isinstance(data, memoryview | bytearray):
        data = bytes(data)
    if isinstance(data, bytes) and data.startswith(OVERSIZE_PREFIX):
        return [oversize_refusal(data)], {}, dict(_EMBED)
    if isinstance(data, bytes) and data.startswith(QUARANTINE_PREFIX):
        return [refused("message_undecodable", "the broker document carrying this message was unreadable",
                        data)], {}, dict(_EMBED)
    if len(data) > MAX_BODY_BYTES:
        return [refused("message_too_large", f"body is {len(data)} bytes; the limit is {MAX_BODY_BYTES}",
                        data)], {}, dict(_EMBED)
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        return [refused("message_undecodable", f"body is not UTF-8 ({exc.reason} at {exc.start})", data)], {}, \
            dict(_EMBED)
    depth = max_depth(text, MAX_DEPTH)
    if depth > MAX_DEPTH:
        return [refused("message_too_deep", f"body nests deeper than {MAX_DEPTH} levels", data)], {}, dict(_EMBED)
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return [refused("message_undecodable", f"body is not JSON: {str(exc)[:120]}", data)], {}, dict(_EMBED)
    if not (isinstance(body, list) and len(body) == 3 and isinstance(body[0], list)
            and isinstance(body[1], dict) and isinstance(body[2], dict | type(None))):
        return [refused("message_malformed", "body is not [args, kwargs, embed]", data)], {}, dict(_EMBED)
    return body[0], body[1], dict(_EMBED)


def oversize_body(document: bytes, limit: int) -> bytes:
    """The stand-in body for a broker document of more than ``limit`` bytes: its true size and
    digest travel with a bounded excerpt, never the document."""
    return OVERSIZE_PREFIX + f"{len(document)}:{limit}:{digest(document)}:".encode() + document[: EXCERPT_CHARS * 4]


def oversize_refusal(data: bytes) -> RefusedBody:
    """The refusal of an oversize stand-in body (:func:`oversize_body`), with the document's own size."""
    size, limit, sha, head = data[len(OVERSIZE_PREFIX):].split(b":", 3)
    return RefusedBody("message_too_large", f"broker document is {int(size)} bytes; the limit is {int(limit)}",
                       sha.decode("ascii"), int(size), excerpt(head))


def dumps(body: Any) -> str:
    """Encode a task body. ASCII-only output: lone surrogates and NUL travel as JSON escapes."""
    return json.dumps(body, ensure_ascii=True, separators=(",", ":"))


def register_serializer() -> None:
    """Register the codec with kombu (idempotent). Every process that sends or consumes calls it."""
    register(NAME, dumps, loads, content_type=CONTENT_TYPE, content_encoding="utf-8")


register_serializer()
