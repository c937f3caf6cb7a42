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
    """Hash of an MCP tool definition as ``tools/list`` serves it: name, input and output schema,
    description and annotations.

    A model and an approver both read the description, and annotations say whether the tool is
    destructive, idempotent or read-only: a reworded description or a changed hint is a changed
    contract, approved again like a changed schema.
    """
    annotations = getattr(tool, "annotations", None)
    if annotations is not None and hasattr(annotations, "model_dump"):
        annotations = annotations.model_dump(mode="json", exclude_none=True)
    return sha256_hex(
        {
            "name": tool.name,
            "input_schema": tool.input_schema,
            "output_schema": getattr(tool, "output_schema", None),
            "description": getattr(tool, "description", None),
            "annotations": annotations or None,
        }
    )
