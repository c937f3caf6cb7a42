"""Canonical JSON and the hashes built on it.

Signatures, argument hashes, contract hashes and idempotency keys are all computed over RFC 8785
canonical JSON, so two processes that hold equal values always produce the same bytes.

The ``rfc8785`` package is the reference and writes every value character by character in Python;
most documents here (envelopes, arguments, evidence) hold only strings, integers, booleans and
null, and for those the standard library's C encoder with sorted keys and no whitespace writes the
very same bytes. :func:`canonical_bytes` takes that path only after checking that the document is
one of them, and hands everything else to ``rfc8785`` (which also raises its own errors for what
cannot be canonicalized): see :func:`_plain_json`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import rfc8785

#: RFC 8785 numbers are IEEE doubles: integers beyond this lose precision (``rfc8785`` refuses them).
_SAFE_INT = 2**53 - 1
#: Keys below the surrogate range sort the same by code point (Python) and by UTF-16 unit (RFC 8785).
_FIRST_SURROGATE = "\ud800"
#: A document larger than this many values is left to ``rfc8785`` without a full check.
_MAX_NODES = 100_000


def _plain_json(value: Any) -> bool:
    """True when ``json.dumps`` with sorted keys writes exactly RFC 8785's bytes for ``value``:
    only dicts with string keys below U+D800, lists, tuples, strings, booleans, None and integers
    within the double-precision range, with no container reached twice (so no cycle). Strings are
    escaped alike by both (the short escapes, lowercase ``\\u00xx`` for other control characters,
    nothing else); a lone surrogate fails the UTF-8 encoding afterwards, which also falls back."""
    stack = [value]
    seen: set[int] = set()
    nodes = 0
    while stack:
        item = stack.pop()
        nodes += 1
        if nodes > _MAX_NODES:
            return False
        if item is None or isinstance(item, bool | str):
            continue
        if isinstance(item, int):
            if -_SAFE_INT <= item <= _SAFE_INT:
                continue
            return False
        if type(item) is dict:
            if id(item) in seen:
                return False
            seen.add(id(item))
            for key in item:
                if not isinstance(key, str) or (not key.isascii() and max(key) >= _FIRST_SURROGATE):
                    return False
            stack.extend(item.values())
        elif type(item) is list or type(item) is tuple:
            if id(item) in seen:
                return False
            seen.add(id(item))
            stack.extend(item)
        else:
            return False  # floats, other mappings and sequences, anything else: the reference decides
    return True


def canonical_bytes(value: Any) -> bytes:
    """RFC 8785 canonical JSON of ``value`` (UTF-8)."""
    if _plain_json(value):
        try:
            return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True,
                              allow_nan=False).encode("utf-8")
        except (UnicodeEncodeError, ValueError, TypeError, RecursionError):
            pass  # a lone surrogate, a document nested too deep: the reference raises its own error
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
