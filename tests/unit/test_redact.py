"""Evidence redaction: named fields are replaced at any depth, case-insensitively, on a copy."""

from __future__ import annotations

import copy

from ledger.redact import MARK, redact

FIELDS = frozenset({"password", "token", "api_key"})


def test_top_level_field_replaced():
    assert redact({"user": "ann", "password": "hunter2"}, FIELDS) == {"user": "ann", "password": MARK}


def test_nested_dicts_and_lists():
    value = {
        "request": {"headers": {"token": "abc", "accept": "json"}, "body": [{"api_key": "k1", "n": 1}, "plain"]},
        "items": [[{"password": "p"}], ({"token": "t", "keep": True},)],
        "count": 3,
    }
    assert redact(value, FIELDS) == {
        "request": {"headers": {"token": MARK, "accept": "json"}, "body": [{"api_key": MARK, "n": 1}, "plain"]},
        "items": [[{"password": MARK}], [{"token": MARK, "keep": True}]],
        "count": 3,
    }


def test_keys_match_case_insensitively():
    value = {"Password": "a", "TOKEN": "b", "Api_Key": "c", "passwords": "not the same field"}
    assert redact(value, FIELDS) == {"Password": MARK, "TOKEN": MARK, "Api_Key": MARK, "passwords": "not the same field"}


def test_whole_subtree_under_a_redacted_key_is_replaced():
    assert redact({"token": {"value": "abc", "expires": 1}}, FIELDS) == {"token": MARK}


def test_values_equal_to_field_names_are_kept():
    assert redact({"kind": "password", "list": ["token"]}, FIELDS) == {"kind": "password", "list": ["token"]}


def test_non_string_keys_do_not_crash():
    assert redact({1: "one", None: {"password": "x"}}, FIELDS) == {1: "one", None: {"password": MARK}}


def test_original_not_mutated():
    value = {"password": "hunter2", "nested": {"token": "abc", "list": [{"api_key": "k"}]}}
    before = copy.deepcopy(value)
    out = redact(value, FIELDS)
    assert value == before
    assert out["nested"] is not value["nested"]
    assert out["nested"]["list"] is not value["nested"]["list"]
    out["nested"]["list"].append("extra")
    assert value == before


def test_no_fields_means_an_equal_copy():
    value = {"password": "x", "a": [1, {"b": 2}]}
    out = redact(value, frozenset())
    assert out == value
    assert out is not value


def test_scalars_pass_through():
    for scalar in ("text", 5, 1.5, None, True):
        assert redact(scalar, FIELDS) == scalar
