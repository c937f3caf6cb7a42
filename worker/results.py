"""Bounded tool results: how big a result is, its digest, and a short excerpt.

A result larger than the limit for its server and contract is never stored or parsed for values:
what the worker keeps of it is its size, a sha256 digest of its payload and a bounded excerpt,
recorded once (in the ``tool_called`` event). Within the limit, the extracted values are stored
once, on the action row; the ledger event and the idempotency record refer to them by digest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from proofline.canonical import sha256_hex
from proofline.contracts import Contract
from proofline.settings import Settings
from worker.servers import Server

EXCERPT_CHARS = 1024


@dataclass(frozen=True)
class Payload:
    """What a result weighs: bytes of every text, binary and structured part, and their digest."""

    size: int
    digest: str
    excerpt: str

    def as_evidence(self, limit: int) -> dict[str, Any]:
        return {"result_size": self.size, "result_digest": self.digest, "result_limit": limit,
                "result_excerpt": self.excerpt}


def _parts(result: Any) -> list[str]:
    """The payload strings of an MCP result: texts, base64 data, resource texts and blobs."""
    parts: list[str] = []
    for block in getattr(result, "content", None) or []:
        for holder in (block, getattr(block, "resource", None)):
            for attr in ("text", "data", "blob"):
                value = getattr(holder, attr, None) if holder is not None else None
                if isinstance(value, str):
                    parts.append(value)
    return parts


def measure(result: Any) -> Payload:
    digest = hashlib.sha256()
    size = 0
    excerpt = ""
    for part in _parts(result):
        raw = part.encode("utf-8", errors="replace")
        size += len(raw)
        digest.update(raw)
        if len(excerpt) < EXCERPT_CHARS:
            excerpt += part[: EXCERPT_CHARS - len(excerpt)]
    structured = getattr(result, "structured_content", None)
    if structured is not None:
        raw = json.dumps(structured, sort_keys=True, default=str).encode()
        size += len(raw)
        digest.update(raw)
        if not excerpt:
            excerpt = raw[:EXCERPT_CHARS].decode(errors="replace")
    return Payload(size, digest.hexdigest(), excerpt)


def result_limit(settings: Settings, server: Server, contract: Contract) -> int:
    """The smallest limit any of the settings, the servers file and the contract declares."""
    declared = [settings.max_result_bytes, server.max_result_bytes, contract.max_result_bytes]
    return min(v for v in declared if v is not None)


def values_reference(values: dict[str, Any] | None) -> dict[str, Any] | None:
    """How the ledger event and the idempotency record point at the values kept on the action row."""
    if values is None:
        return None
    return {"result_digest": sha256_hex(values), "result_bytes": len(json.dumps(values, default=str))}
