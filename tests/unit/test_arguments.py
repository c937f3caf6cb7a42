"""Arguments against a pinned input schema (pure logic): the JSON path of what fails, a stable
code, and a schema that is no JSON Schema reported as configuration, not blamed on the arguments."""

from __future__ import annotations

import pytest

from proofline.arguments import SHOWN_ERRORS, check_arguments
from proofline.errors import ArgumentsInvalid, ConfigurationError

REFUND = {"type": "object", "required": ["account", "amount_cents"], "additionalProperties": False,
          "properties": {"account": {"type": "string"}, "amount_cents": {"type": "integer", "minimum": 1},
                         "meta": {"type": "object", "properties": {"ref": {"type": "string"}}}}}


def refusal(arguments: dict) -> ArgumentsInvalid:
    with pytest.raises(ArgumentsInvalid) as raised:
        check_arguments("issue_refund", REFUND, arguments)
    assert raised.value.code == "arguments_invalid" and raised.value.context["tool"] == "issue_refund"
    return raised.value


def test_matching_arguments_pass() -> None:
    check_arguments("issue_refund", REFUND, {"account": "a-1", "amount_cents": 5, "meta": {"ref": "x"}})


def test_a_missing_required_argument_names_it() -> None:
    err = refusal({"account": "a-1"})
    assert "'amount_cents' is a required property" in err.detail and err.context["path"] == "$"


def test_a_nested_wrong_type_names_its_path() -> None:
    err = refusal({"account": "a-1", "amount_cents": 5, "meta": {"ref": 7}})
    assert err.context["path"] == "$.meta.ref" and "$.meta.ref: 7 is not of type 'string'" in err.detail


def test_many_errors_are_counted_not_all_listed() -> None:
    err = refusal({"account": 1, "amount_cents": 0, "x": 1, "y": 2, "meta": {"ref": 3}})
    assert err.detail.count("; ") == SHOWN_ERRORS - 1 and "more)" in err.detail


def test_an_invalid_schema_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="not a valid JSON Schema") as raised:
        check_arguments("issue_refund", {"type": "no-such-type"}, {})
    assert not isinstance(raised.value, ArgumentsInvalid)
