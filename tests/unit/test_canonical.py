"""canonical_bytes writes exactly what the rfc8785 reference writes, for every input, and raises
where it raises (the fast path may only ever take documents it writes identically)."""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from proofline.canonical import _plain_json, canonical_bytes

# Every code point, surrogates included, and the characters whose escaping or ordering differs.
texts = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=12) | st.sampled_from(
    ["", "\x00", "\x1f", "\x7f", "\u2028", "\ud800", "\udfff", "\ue000", "\uffff", "\U0001f600", '"', "\\", "\b\f\n\r\t"])
integers = st.integers(min_value=-(2**60), max_value=2**60) | st.sampled_from([2**53 - 1, 2**53, -(2**53 - 1), -(2**53)])
scalars = st.none() | st.booleans() | integers | texts | st.floats(allow_nan=True, allow_infinity=True)
documents = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                         | st.dictionaries(texts, inner, max_size=4), max_leaves=20)


def _reference(value: Any) -> tuple[str, Any]:
    try:
        return "ok", rfc8785.dumps(value)
    except Exception as exc:  # noqa: BLE001 - the error's type is what is compared
        return "error", type(exc)


def _ours(value: Any) -> tuple[str, Any]:
    try:
        return "ok", canonical_bytes(value)
    except Exception as exc:  # noqa: BLE001
        return "error", type(exc)


@settings(max_examples=2000, deadline=None)
@given(documents)
def test_same_bytes_or_same_error_as_the_reference(value: Any) -> None:
    assert _ours(value) == _reference(value)


def test_plain_documents_take_the_fast_path() -> None:
    document = {"b": [1, 2, {"z": "é\n\x01\"", "a": True}], "a": None, "é": "x", "ÿ": -5, "t": (1, "two")}
    assert _plain_json(document)
    assert canonical_bytes(document) == rfc8785.dumps(document)


@pytest.mark.parametrize("value", [
    {"f": 1e-7},  # exponent notation differs (Python writes 1e-07)
    {"f": 1e21},  # so does a large integral float
    {"f": float("nan")},
    {"n": 2**53},  # beyond a double's integers: refused by the reference
    {"\U0001f600": 1, "\ue000": 2},  # UTF-16 order differs from code point order here
    {1: "non-string key"},
    {"s": {1, 2}},
])
def test_documents_the_fast_path_leaves_to_the_reference(value: Any) -> None:
    assert not _plain_json(value)
    assert _ours(value) == _reference(value)


@pytest.mark.parametrize("number", [30.0, -0.0, 1.5, 0.1, 0.0001, 123456.789, 2.0**52 + 0.5, 9007199254740991.0,
                                    -1234.5e-3])
def test_ordinary_floats_take_the_fast_path(number: float) -> None:
    document = {"timeout_seconds": number, "nested": [number, {"x": number}]}
    assert _plain_json(document)
    assert canonical_bytes(document) == rfc8785.dumps(document)


def test_a_shared_or_cyclic_container_is_left_to_the_reference() -> None:
    shared = ["x"]
    assert not _plain_json({"a": shared, "b": shared})
    assert canonical_bytes({"a": shared, "b": shared}) == rfc8785.dumps({"a": shared, "b": shared})
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    assert not _plain_json(cyclic)
    assert _ours(cyclic) == _reference(cyclic)


def test_string_and_integer_enums_serialize_as_their_values() -> None:
    class Colour(str, Enum):
        RED = "red"

    class Size(IntEnum):
        BIG = 7

    document = {"colour": Colour.RED, "size": Size.BIG}
    assert canonical_bytes(document) == rfc8785.dumps(document) == b'{"colour":"red","size":7}'
