"""Bounded, printable copies of untrusted values, for refusal evidence and error messages.

Bounded in depth, breadth and length, with no lone surrogates, no NUL, no integers too long to
print and no ``repr`` of arbitrary objects: Postgres ``jsonb`` refuses lone surrogates and U+0000,
Python refuses to print huge integers and ``repr`` recurses; each of those once turned a refusal
into an exception. Pure functions: no I/O.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

MAX_DEPTH = 6
MAX_ITEMS = 40
MAX_STR = 300


def safe_str(value: str, limit: int = MAX_STR) -> str:
    """Printable, valid UTF-8, NUL-free, bounded."""
    text = value[: limit * 2].encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\x00", "\\x00")[:limit]


def safe(value: Any, depth: int = 0) -> Any:
    """A JSON- and jsonb-safe, bounded copy of ``value``."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if -(2**63) < value < 2**63:
            return value
        return f"<int of {value.bit_length()} bits>"
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return safe_str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return safe_str(bytes(value[: MAX_STR * 2]).decode("utf-8", "backslashreplace"))
    if depth >= MAX_DEPTH:
        return f"<{type(value).__name__} nested deeper than {MAX_DEPTH}>"
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for i, (k, v) in enumerate(value.items()):
            if i >= MAX_ITEMS:
                out["<truncated>"] = f"{len(value) - MAX_ITEMS} more keys"
                break
            key = safe_str(k, 80) if isinstance(k, str) else f"<{type(k).__name__} key {i}>"
            out[key] = safe(v, depth + 1)
        return out
    if isinstance(value, list | tuple):
        items = [safe(v, depth + 1) for v in value[:MAX_ITEMS]]
        if len(value) > MAX_ITEMS:
            items.append(f"<{len(value) - MAX_ITEMS} more items>")
        return items
    evidence = getattr(value, "evidence", None)
    if callable(evidence):
        try:
            return safe(evidence(), depth + 1)
        except Exception:  # noqa: BLE001 - fall through to the type name
            pass
    return f"<{type(value).__name__}>"


def safe_repr(value: Any, limit: int = MAX_STR) -> str:
    """``repr`` that cannot raise (recursion, huge ints, hostile ``__repr__``) and is bounded."""
    try:
        return safe_str(repr(value), limit)
    except Exception:  # noqa: BLE001 - RecursionError, ValueError, anything a hostile object raises
        return f"<{type(value).__name__}: unrepresentable>"


def stable_digest(value: Any) -> str:
    """A digest of any value: of its safe copy when nothing better exists."""
    return hashlib.sha256(json.dumps(safe(value), sort_keys=True).encode()).hexdigest()
