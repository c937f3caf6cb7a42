"""Canonical JSON and the hashes built on it.

Signatures, argument hashes, contract hashes and idempotency keys are all computed over RFC 8785
canonical JSON, so two processes that hold equal values always produce the same bytes.

The ``rfc8785`` package is the reference and writes every value character by character in Python;
most documents here (envelopes, arguments, evidence) hold only strings, integers, booleans, null
and ordinary floats, and for those the standard library's C encoder with sorted keys and no
whitespace writes the very same bytes. :func:`canonical_bytes` takes that path only after checking that the document is
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


#: Non-integral floats in this range are written alike by Python's ``repr`` (shortest round-trip
#: digits, fixed notation from 1e-4 to below 1e16) and by RFC 8785 (ECMAScript: the same digits,
#: fixed notation from 1e-6 to below 1e21).
_FIXED_FLOATS = (1e-4, 1e16)

_NOT_PLAIN, _PLAIN, _FLOATS = 0, 1, 2


def _float_kind(number: float) -> int:
    """How a float can be written: as an integer (integral, within the safe range), as Python writes
    it (:data:`_FIXED_FLOATS`), or only by the reference (exponents, NaN, infinities)."""
    if number.is_integer():
        return _FLOATS if -_SAFE_INT <= number <= _SAFE_INT else _NOT_PLAIN
    return _FLOATS if _FIXED_FLOATS[0] <= abs(number) < _FIXED_FLOATS[1] else _NOT_PLAIN


def _plain_json(value: Any) -> int:
    """Whether ``json.dumps`` with sorted keys writes exactly RFC 8785's bytes for ``value``:
    ``_PLAIN`` for dicts with string keys below U+D800, lists, tuples, strings, booleans, None and
    integers within the double-precision range, with no container reached twice (so no cycle);
    ``_FLOATS`` when it also holds floats that :func:`_with_floats_as_written` makes so;
    ``_NOT_PLAIN`` otherwise. Strings are escaped alike by both (the short escapes, lowercase
    ``\\u00xx`` for other control characters, nothing else); a lone surrogate fails the UTF-8
    encoding afterwards, which also falls back."""
    stack = [value]
    seen: set[int] = set()
    nodes = 0
    kind = _PLAIN
    while stack:
        item = stack.pop()
        nodes += 1
        if nodes > _MAX_NODES:
            return _NOT_PLAIN
        if item is None or isinstance(item, bool | str):
            continue
        if isinstance(item, int):
            if -_SAFE_INT <= item <= _SAFE_INT:
                continue
            return _NOT_PLAIN
        if isinstance(item, float):
            if _float_kind(float(item)) == _NOT_PLAIN:
                return _NOT_PLAIN
            kind = _FLOATS
        elif type(item) is dict:
            if id(item) in seen:
                return _NOT_PLAIN
            seen.add(id(item))
            for key in item:
                if not isinstance(key, str) or (not key.isascii() and max(key) >= _FIRST_SURROGATE):
                    return _NOT_PLAIN
            stack.extend(item.values())
        elif type(item) is list or type(item) is tuple:
            if id(item) in seen:
                return _NOT_PLAIN
            seen.add(id(item))
            stack.extend(item)
        else:
            return _NOT_PLAIN  # other mappings and sequences, anything else: the reference decides
    return kind


def _with_floats_as_written(value: Any) -> Any:
    """A copy in which every integral float is an integer (RFC 8785 writes ``30.0`` as ``30``); the
    other floats are left to ``repr``, which writes them as RFC 8785 does (checked by the caller)."""
    if isinstance(value, float):
        number = float(value)
        return int(number) if number.is_integer() else number
    if type(value) is dict:
        return {key: _with_floats_as_written(item) for key, item in value.items()}
    if type(value) is list or type(value) is tuple:
        return [_with_floats_as_written(item) for item in value]
    return value


def canonical_bytes(value: Any) -> bytes:
    """RFC 8785 canonical JSON of ``value`` (UTF-8)."""
    kind = _plain_json(value)
    if kind != _NOT_PLAIN:
        try:
            document = value if kind == _PLAIN else _with_floats_as_written(value)
            return json.dumps(document, ensure_ascii=False, separators=(",", ":"), sort_keys=True,
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
