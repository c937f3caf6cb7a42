"""The redaction policy (ledger/redact.py): names by word parts, declared names, value patterns and
an action's own secret values, applied at any depth on a copy."""

from __future__ import annotations

import copy

import pytest

from ledger.redact import (
    MARK,
    Redactor,
    for_envelope,
    for_message,
    leaf_names,
    name_parts,
    redact,
    scrub_text,
    sensitive_name,
)
from proofline.contracts import Contract, load_contracts
from proofline.envelope import Envelope
from proofline.settings import ROOT

FIELDS = frozenset({"password", "token", "api_key"})

SECRET_NAMES = [
    "access_token", "apiKey", "client_secret", "Authorization", "authorization", "private_key", "access_key",
    "X-Api-Key", "API_KEY", "api.key", "api key", "APIKey", "apikey", "AWS_SECRET_ACCESS_KEY", "db_password",
    "passwd", "Password", "passphrase", "Cookie", "Set-Cookie", "session", "session_id", "sessionToken",
    "credentials", "refreshToken", "signing_key", "encryption_key", "bearer", "basic_auth", "pwd", "token",
]
KEPT_NAMES = [
    "idempotency_key", "idempotencyKey", "key_id", "keyId", "key", "arguments_hash", "contract_hash",
    "tool_contract_hash", "fencing_token", "previous_fencing_token", "verification_key", "target_key",
    "public_key", "authority_budget", "tokenizer", "title", "redact_fields", "recorded_argument_hash", "keys",
    "amount_cents", "owner", "tenant", "author",
]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_names_are_redacted(name: str) -> None:
    assert sensitive_name(name), name
    assert redact({name: "s3cr3t-value", "other": 1}) == {name: MARK, "other": 1}


@pytest.mark.parametrize("name", KEPT_NAMES)
def test_identifiers_the_runtime_needs_are_kept(name: str) -> None:
    assert not sensitive_name(name), name
    assert redact({name: "pl1-abc"}) == {name: "pl1-abc"}


def test_word_parts_ignore_case_and_separators() -> None:
    assert name_parts("X-Api-Key") == name_parts("x_api_key") == name_parts("xApiKey") == ["x", "api", "key"]
    assert name_parts("APIKey") == ["api", "key"]


def test_every_envelope_field_survives_redaction() -> None:
    """The stored envelope is a redacted copy that must still be an envelope."""
    for name in Envelope.model_fields:
        assert not sensitive_name(name), name


def test_declared_fields_match_like_policy_names() -> None:
    value = {"Note": "a", "NOTE": "b", "notes": "c", "my_note": "d"}
    assert redact(value, ["note"]) == {"Note": MARK, "NOTE": MARK, "notes": "c", "my_note": "d"}


def test_nested_dicts_and_lists() -> None:
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


def test_whole_subtree_under_a_secret_name_is_replaced() -> None:
    assert redact({"token": {"value": "abc", "expires": 1}}) == {"token": MARK}


def test_values_equal_to_field_names_are_kept() -> None:
    assert redact({"kind": "password", "list": ["token"]}) == {"kind": "password", "list": ["token"]}


def test_non_string_keys_do_not_crash() -> None:
    assert redact({1: "one", None: {"password": "x"}}) == {1: "one", None: {"password": MARK}}


def test_original_not_mutated() -> None:
    value = {"password": "hunter2", "nested": {"token": "abc", "list": [{"api_key": "k"}]}}
    before = copy.deepcopy(value)
    out = redact(value, FIELDS)
    assert value == before
    assert out["nested"] is not value["nested"]
    out["nested"]["list"].append("extra")
    assert value == before


def test_scalars_pass_through() -> None:
    for scalar in (5, 1.5, None, True, "plain text"):
        assert redact(scalar) == scalar


# --- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("card", ["4111111111111111", "4111 1111 1111 1111", "4111-1111-1111-1111",
                                  "5500005555555559", "378282246310005", "6011000990139424"])
def test_card_numbers_passing_luhn_are_redacted_in_text(card: str) -> None:
    assert scrub_text(f"paid with {card}.") == f"paid with {MARK}."
    assert redact({"reason": f"card {card} declined"}) == {"reason": f"card {MARK} declined"}


@pytest.mark.parametrize("text", [
    "4111111111111112",              # fails Luhn
    "acct-4111111111111111",         # part of an identifier
    "pl1-4111111111111111abc",       # part of a key
    "1111111111111117",              # no card network starts with 1
    "2026-11-30T19:00:26+00:00",     # a timestamp
    "ref 123456789012",              # too short
])
def test_numbers_that_are_not_cards_are_kept(text: str) -> None:
    assert scrub_text(text) == text


def test_bearer_and_basic_credentials_are_redacted() -> None:
    assert scrub_text("Authorization: Bearer eyJhbGciOi.J9.abc-_x== next") == f"Authorization: Bearer {MARK} next"
    assert scrub_text("basic dXNlcjpwYXNz") == f"basic {MARK}"
    assert redact({"header": "bearer abc.def"}) == {"header": f"bearer {MARK}"}


def test_pem_private_keys_are_redacted() -> None:
    pem = "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIB\nabc\n-----END EC PRIVATE KEY-----"
    assert scrub_text(f"key: {pem} done") == f"key: {MARK} done"
    assert scrub_text("-----BEGIN PRIVATE KEY-----\nMIIE truncated") == MARK
    public = "-----BEGIN PUBLIC KEY-----\nMFkw\n-----END PUBLIC KEY-----"
    assert scrub_text(public) == public


# --- one action's redactor ----------------------------------------------------------------------


def _envelope(arguments: dict, redact_fields: list[str] | None = None) -> dict:
    doc: dict = {"action_id": "a-1", "arguments": arguments}
    if redact_fields is not None:
        doc["evidence"] = {"redact_fields": redact_fields}
    return doc


def test_an_actions_secret_values_are_redacted_wherever_they_reappear() -> None:
    red = for_envelope(_envelope({"api_key": "sk-live-0123456789", "title": "t", "nested": {"pin": 123456}}),
                       ["args.nested.pin"])
    echoed = {"result": {"message": "created with key sk-live-0123456789", "pin_echo": "pin 123456"},
              "error": "invalid input 'sk-live-0123456789'"}
    assert red(echoed) == {"result": {"message": f"created with key {MARK}", "pin_echo": f"pin {MARK}"},
                           "error": f"invalid input '{MARK}'"}


def test_contract_fields_and_envelope_declarations_name_secrets() -> None:
    red = for_envelope(_envelope({"note": "my private note", "memo": "memo text x"}, ["memo"]), ["args.note"])
    assert red.names == frozenset({"note", "memo"})
    assert red({"before": {"note": "x", "memo": "y", "other": "my private note!"}}) == {
        "before": {"note": MARK, "memo": MARK, "other": f"{MARK}!"}}


def test_short_values_are_not_hunted_in_text() -> None:
    red = for_envelope(_envelope({"password": "abc"}))
    assert red.secrets == ()
    assert red({"text": "abc def", "password": "abc"}) == {"text": "abc def", "password": MARK}


def test_longest_secret_is_replaced_first() -> None:
    red = for_envelope(_envelope({"token": "abcdef", "secret": "abcdefghij"}))
    assert red.text("x abcdefghij y") == f"x {MARK} y"


def test_any_message_shape_gets_a_redactor() -> None:
    for message in (None, "text", [1, 2], {"envelope": "x"}, {"envelope": {"arguments": "x"}},
                    {"envelope": {"arguments": {"password": "hunter22"}, "evidence": {"redact_fields": 5}}}):
        assert isinstance(for_message(message), Redactor)
    red = for_message({"envelope": {"arguments": {"password": "hunter22"}}})
    assert red.text("echo hunter22") == f"echo {MARK}"


def test_merged_redactors_keep_both() -> None:
    a, b = for_envelope(_envelope({"token": "secret-one"}), ["args.x"]), for_envelope(_envelope({"pwd": "secret-two"}))
    both = a.merged(b)
    assert both.text("secret-one secret-two") == f"{MARK} {MARK}"
    assert "x" in both.names


def test_leaf_names() -> None:
    assert leaf_names(["args.note", "result.auth.pin"]) == ["note", "pin"]


def test_contract_sensitive_fields_are_validated() -> None:
    contract = load_contracts(ROOT / "contracts").contracts["ticket.create"]
    doc = contract.model_dump(exclude={"digest"})
    assert Contract.model_validate({**doc, "sensitive_fields": ["args.note", "result.x.y"]}).sensitive_fields
    for bad in (["note"], ["envelope.arguments"], ["args."], ["args.a b"]):
        with pytest.raises(ValueError):
            Contract.model_validate({**doc, "sensitive_fields": bad})


def test_a_message_nested_past_the_recursion_limit_still_gets_a_redactor() -> None:
    deep: object = "x"
    for _ in range(5000):
        deep = [deep]
    red = for_message({"envelope": {"arguments": {"password": "hunter22", "deep": deep}}})
    assert isinstance(red, Redactor) and red.text("card 4111111111111111") == f"card {MARK}"


@pytest.mark.parametrize(("text", "kept", "gone"), [
    ("note: the password is hunter2 for now", "note: the password is", "hunter2"),
    ("PASSWORD: hunter2", "PASSWORD:", "hunter2"),
    ("retry with token=abcdef123456; then stop", "then stop", "abcdef123456"),
    ('{"comment": "api_key: XYZ123456"}', "api_key:", "XYZ123456"),
    ("dsn postgresql://app:s3cr3t-pw@db:5432/orders", "postgresql://app:", "s3cr3t-pw"),
    ("broker redis://:pw-123456@cache:6379/0", "@cache:6379/0", "pw-123456"),
])
def test_secrets_in_free_text_and_urls_are_scrubbed(text: str, kept: str, gone: str) -> None:
    scrubbed = scrub_text(text)
    assert gone not in scrubbed and kept in scrubbed and MARK in scrubbed


@pytest.mark.parametrize("text", ["the monkey has 5 keys", "see https://example.com/path@v2", "mail ops@example.com",
                                  "a token of thanks", "https://api.example.com/v1/items"])
def test_text_without_a_named_secret_is_left_alone(text: str) -> None:
    assert scrub_text(text) == text
