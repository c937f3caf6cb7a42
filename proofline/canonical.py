"""Canonical JSON and the hashes built on it.

Signatures, argument hashes, contract hashes and idempotency keys are all computed over RFC 8785
canonical JSON, so two processes that hold equal values always produce the same bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import rfc8785


def canonical_bytes(value: Any) -> bytes:
    return rfc8785.dumps(value)


def sha256_hex(value: Any) -> str:
    return hashlib.sha256(canonical_bytes(value)).hexdigest()
