"""Evidence redaction: named fields never reach the ledger with their values."""

from __future__ import annotations

from typing import Any

MARK = "[redacted]"


def redact(value: Any, fields: frozenset[str]) -> Any:
    """Return a copy of ``value`` with every mapping entry whose key is in ``fields`` replaced."""
    if isinstance(value, dict):
        return {k: (MARK if str(k).lower() in fields else redact(v, fields)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v, fields) for v in value]
    return value
