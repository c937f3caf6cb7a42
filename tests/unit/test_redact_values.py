"""Redaction by value (ledger/redact.py ``scrub_text``), as a property over generated text: a secret
embedded in a phrasing the policy promises to catch (a named secret in free text, the password of
a URL or DSN, a well-known credential shape) never survives, and the words around it, the URL's
scheme, user and host do."""

from __future__ import annotations

import string

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from ledger.redact import MARK, scrub_text

#: Prose around the secret: plain words that no value pattern treats as a credential.
WORDS = st.sampled_from(["the", "ticket", "for", "customer", "acme", "refund", "note", "please", "rotate",
                         "after", "deploy", "failed", "on", "db-7", "queue", "42", "today", "ops", "urgent"])
PROSE = st.lists(WORDS, min_size=0, max_size=6).map(" ".join)

#: Secret characters: printable, no whitespace and no quotes (a quoted phrasing delimits with them).
SECRET_CHARS = string.ascii_letters + string.digits + "/+=-_.@:!#$%^&*()[]{},;~?<>|\\"
SECRETS = st.text(alphabet=SECRET_CHARS, min_size=6, max_size=40).filter(
    lambda s: sum(c.isalnum() for c in s) >= 3)

#: How free text names a secret: (name, separator) pairs, the value follows.
NAMES = st.sampled_from(["password", "Password", "PASSWORD", "passwd", "passphrase", "pwd", "secret",
                         "client secret", "client_secret", "db_password", "DB_PASSWORD", "PGPASSWORD", "token",
                         "access token", "access_token", "refresh_token", "auth_token", "api key", "api_key",
                         "API-KEY", "x-api-key", "apiKey", "access key", "private_key", "AWS_SECRET_ACCESS_KEY",
                         "secret_key", "passwords"])
SEPARATORS = st.sampled_from(["=", " = ", ": ", ":", " is ", " was ", " is: ", " is = "])
QUOTES = st.sampled_from(["", '"', "'"])


def check(text: str, secret: str, kept: list[str]) -> None:
    """The secret is gone from the scrubbed text, every kept part is still there."""
    assume(secret not in text.replace(secret, "", 1) and secret not in MARK)  # it occurs once, alone
    scrubbed = scrub_text(text)
    assert secret not in scrubbed, (text, scrubbed)
    for part in kept:
        assert part in scrubbed, (text, scrubbed, part)


@st.composite
def named_secret(draw: st.DrawFn) -> tuple[str, str, list[str]]:
    """``<prose> <name><sep><value> <prose>``, also as a JSON/dict entry with the value quoted."""
    before, after, secret = draw(PROSE), draw(PROSE), draw(SECRETS)
    name, sep, quote = draw(NAMES), draw(SEPARATORS), draw(QUOTES)
    if quote and draw(st.booleans()):
        phrase = f"{quote}{name}{quote}: {quote}{secret}{quote}"  # {"password": "…"}, {'token': '…'}
    else:
        phrase = f"{name}{sep}{quote}{secret}{quote}"
    return f"{before} {phrase} {after}".strip(), secret, [w for w in f"{before} {after}".split() if w]


def _userinfo_url(draw: st.DrawFn) -> tuple[str, str, str, str]:
    scheme = draw(st.sampled_from(["postgresql", "postgres", "postgresql+psycopg", "redis", "rediss", "amqp",
                                   "amqps", "https", "http", "mysql", "mongodb+srv", "sftp"]))
    user = draw(st.sampled_from(["app", "ops", "guest", "", "x-access-token", "svc.reader", "u_1"]))
    host = draw(st.sampled_from(["db", "db-7.internal", "cache.example.com", "10.0.0.5", "rabbit", "[::1]"]))
    port = draw(st.sampled_from(["", ":5432", ":6379", ":5672", ":443"]))
    path = draw(st.sampled_from(["", "/", "/orders", "/0", "/vhost", "/api/v1/items"]))
    query = draw(st.sampled_from(["", "?sslmode=require", "?timeout=5&ssl=true", "#frag"]))
    secret = draw(SECRETS)
    return f"{scheme}://{user}:{secret}@{host}{port}{path}{query}", secret, f"{scheme}://{user}:", f"@{host}{port}"


@st.composite
def url_secret(draw: st.DrawFn) -> tuple[str, str, list[str]]:
    url, secret, head, tail = _userinfo_url(draw)
    before, after = draw(PROSE), draw(PROSE)
    wrap = draw(st.sampled_from(["{}", "({})", "<{}>", "dsn={}", "'{}'", "{},"]))
    return f"{before} {wrap.format(url)} {after}".strip(), secret, [head, tail, *before.split(), *after.split()]


@settings(max_examples=400, deadline=None)
@given(named_secret())
@example(("the password is: hunter2-x ok", "hunter2-x", ["the", "ok"]))
@example(("retry db_password=ab,cd;ef then", "ab,cd;ef", ["retry", "then"]))
@example(("{'password': 'p@ss/w0rd'}", "p@ss/w0rd", []))
def test_a_named_secret_in_free_text_never_survives(case: tuple[str, str, list[str]]) -> None:
    check(*case)


@settings(max_examples=400, deadline=None)
@given(url_secret())
@example(("dsn postgresql://app:ab/c@d@db:5432/x ok", "ab/c@d", ["postgresql://app:", "@db:5432", "ok"]))
@example(("redis://:p@ss@cache:6379/0", "p@ss", ["@cache:6379"]))
def test_the_password_of_a_url_never_survives(case: tuple[str, str, list[str]]) -> None:
    check(*case)


# --- well-known credential shapes, no naming word --------------------------------------------------

B62 = string.ascii_letters + string.digits
B64URL = B62 + "-_"


def _text(alphabet: str, size: int) -> st.SearchStrategy[str]:
    return st.text(alphabet=alphabet, min_size=size, max_size=size)


SHAPES = st.one_of(
    _text(string.ascii_uppercase + string.digits, 16).flatmap(
        lambda tail: st.sampled_from(["AKIA", "ASIA"]).map(lambda head: head + tail)),
    _text(B62, 36).flatmap(lambda tail: st.sampled_from(["ghp_", "gho_", "ghu_", "ghs_", "ghr_"]).map(
        lambda head: head + tail)),
    _text(B62 + "_", 82).map(lambda tail: "github_pat_" + tail),
    st.tuples(st.sampled_from("abprs"), _text(string.digits, 12), _text(B62, 24)).map(
        lambda t: f"xox{t[0]}-{t[1]}-{t[1][:6]}-{t[2]}"),
    st.tuples(_text(B64URL, 20), _text(B64URL, 40), _text(B64URL, 43)).map(
        lambda t: f"eyJ{t[0]}.eyJ{t[1]}.{t[2]}"),
    st.tuples(st.sampled_from(["", "RSA ", "EC ", "OPENSSH "]), _text(B62 + "+/", 64)).map(
        lambda t: f"-----BEGIN {t[0]}PRIVATE KEY-----\n{t[1]}\n{t[1][::-1]}=\n-----END {t[0]}PRIVATE KEY-----"),
    _text(B64URL + ".~+/", 30).map(lambda tok: f"Bearer {tok}"),
)


@settings(max_examples=300, deadline=None)
@given(PROSE, SHAPES, PROSE, st.sampled_from(["{}", "({})", "'{}'", '"{}"', "{}.", "{},", "x={}"]))
def test_well_known_credential_shapes_never_survive(before: str, secret: str, after: str, wrap: str) -> None:
    text = f"{before} {wrap.format(secret)} {after}".strip()
    scrubbed = scrub_text(text)
    body = secret.removeprefix("Bearer ")
    assert body not in scrubbed, (text, scrubbed)
    for word in (*before.split(), *after.split()):
        assert word in scrubbed, (text, scrubbed, word)


@pytest.mark.parametrize("text", [
    "the fencing_token=17 and idempotency_key=pl1-abc", "verification_key: verify-pl1-abc", "a token of thanks",
    "see https://example.com/path@v2", "mail ops@example.com", "ghp_short is not a token", "AKIA is a prefix",
    "eyJ alone", "the key is in the drawer", "xoxo-hugs", "github_pat_", "sort_key: created_at",
])
def test_look_alikes_are_left_alone(text: str) -> None:
    assert scrub_text(text) == text
