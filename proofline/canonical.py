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


def tool_contract_hash(tool: Any) -> str:
    """Hash of an MCP tool definition as ``tools/list`` serves it: name, input and output schema.

    Descriptions and annotations are advisory and may be reworded; the schemas are the contract.
    """
    return sha256_hex(
        {
            "name": tool.name,
            "input_schema": tool.input_schema,
            "output_schema": getattr(tool, "output_schema", None),
        }
    )
