"""The one redaction policy: what never reaches storage, logs, Sentry or Flower with its value.

Three rules, applied to a copy at any depth:

- **names**: a mapping entry whose key names a secret is replaced whole. Keys are split into word
  parts (``apiKey``, ``API-KEY``, ``api_key`` and ``api.key`` are all ``api`` + ``key``), so
  case and separators do not matter. Secret words: token, secret, password/passwd/passphrase,
  authorization/auth, cookie, session, credential, and ``key`` as the last word part after a
  qualifier (``api_key``, ``private_key``, ``access_key``). Identifiers the runtime itself needs
  are kept: a ``key`` or ``token`` qualified by ``idempotency``, ``verification``, ``target``,
  ``fencing``, ``public`` …, ``key`` alone (the ledger's name for an idempotency key) and
  ``key_id``.
- **declared names**: the envelope's ``evidence.redact_fields`` and the contract's
  ``sensitive_fields`` (``args.note`` declares ``note``), matched the same way.
- **values**: in every string, payment card numbers that pass the Luhn check, ``Bearer``/``Basic``
  credentials, PEM private keys, the password of a URL or DSN, a value free text names as a secret
  (``the password is …``, ``DB_PASSWORD=…``), AWS key ids, GitHub and Slack tokens and JWTs; and
  the values the action's own arguments hold under a secret or declared name, wherever they
  reappear (an echo in a tool result or an error message).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

MARK = "[redacted]"

_WORDS = re.compile(r"[A-Z]+(?=[A-Z][a-z0-9])|[A-Z]?[a-z0-9]+|[A-Z]+")
#: Anywhere inside a word part: these are secrets however they are compounded (``dbpassword``).
_SECRET_SUBSTRINGS = ("password", "passwd", "passphrase", "secret", "credential", "cookie", "authorization",
                      "apikey", "privatekey", "accesskey", "accesstoken", "refreshtoken", "sessiontoken",
                      "bearer")
#: Whole word parts that name a secret.
_SECRET_WORDS = frozenset({"token", "tokens", "auth", "pwd", "session", "sessionid", "jwt", "otp", "cvv"})
#: A ``key`` or ``token`` after one of these is an identifier, not a credential.
_IDENTIFIER_QUALIFIERS = frozenset({
    "idempotency", "verification", "target", "fencing", "public", "partition", "sort", "cache", "lock",
    "routing", "dedup", "deduplication", "primary", "foreign", "lookup", "row", "object", "group", "message",
    "queue", "page", "next", "continuation", "cursor", "natural", "unique", "composite", "index", "shard",
    "bucket", "map", "search", "previous", "stale",
})

# A card number: 13-19 digits (spaces or dashes between groups), first digit 2-6 (the card
# networks), standing on its own: not glued to an identifier such as ``acct-4111…``.
_CARD = re.compile(r"(?<![\w\-./:])[2-6](?:[ -]?\d){12,18}(?![\w\-/:])(?!\.\w)")
_BEARER = re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9\-._~+/]+=*")
_PEM = re.compile(r"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----.*?(?:-----END \1PRIVATE KEY-----|\Z)", re.S)
# A URL or DSN that carries a password: ``scheme://user:password@host`` keeps the user and the host.
# The password runs to the last ``@`` before whitespace or a double quote: written in free text it is
# often not percent-encoded, and may hold ``/``, ``:`` or ``@`` itself.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://[^\s/:@\"]*):[^\s\"]+@")
# A secret named in free text: ``password=…``, ``token: …``, ``the api key is …``, ``{"pwd": "…"}``.
# Password words count inside any name (``PGPASSWORD``, ``db_password``); token and key words must
# start a word part, and one an identifier qualifies (``fencing_token``) is left to the callback.
_NAMED_SECRET = re.compile(
    r"(?i)((?:password|passwd|passphrase|secret(?:[ _-]?(?:access[ _-]?)?key)?)s?|"
    r"(?<![a-z0-9])(?:pwd|tokens?|(?:api|access|private|signing|encryption|master)[ _-]?keys?))"
    r"([\"']?(?:\s*[:=]\s*|\s+(?:is|was|are)(?:\s*[:=])?\s+))"
    # The value (not one already redacted): quoted up to its closing quote, or a run of non-space up
    # to trailing punctuation.
    r"(?!\[redacted\])(?:([\"'])(?:(?!\3).)+\3|\S+?(?=[)\]}\"',;.!?:]*(?:\s|\Z)))")
# Well-known credential shapes that need no naming word: AWS access key ids, GitHub tokens, Slack
# tokens and JSON Web Tokens (a header and a payload, both base64url JSON objects).
_SHAPES = re.compile(
    r"(?<![A-Za-z0-9])(?:(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}(?![A-Za-z0-9])"
    r"|gh[pousr]_[A-Za-z0-9]{36,255}(?![A-Za-z0-9])|github_pat_[A-Za-z0-9_]{22,255}"
    r"|xox[abprs]-[A-Za-z0-9-]{10,}|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*)")
# Cheap first looks, so most strings skip the full patterns (substring tests on the lowered text
# cost a fraction of a case-insensitive regex search).
_MAYBE_NAMED = ("pass", "pwd", "secret", "token", "key")
_MAYBE_SHAPE = ("eyj", "xox", "gh", "github_pat_", "akia", "asia", "abia", "acca")
_MAYBE_CARD = re.compile(r"\d{4}")
#: Shorter argument values are not hunted for inside other text (a 3-letter value would erase words).
MIN_SECRET_LENGTH = 6


def name_parts(name: Any) -> list[str]:
    """``"X-Api-Key"`` → ``["x", "api", "key"]``; ``"clientSecret"`` → ``["client", "secret"]``."""
    return list(_parts(str(name)))


@lru_cache(maxsize=4096)
def _parts(name: str) -> tuple[str, ...]:
    return tuple(p.lower() for p in _WORDS.findall(name))


def normalize(name: Any) -> str:
    """The separator- and case-free form declared names are compared in (``api_key`` == ``apiKey``)."""
    return "".join(_parts(str(name)))


def sensitive_name(name: Any) -> bool:
    """Whether a mapping key names a secret by the policy's own rules."""
    return _sensitive(str(name))


# Key names repeat across every event of every action: decide each once.
@lru_cache(maxsize=4096)
def _sensitive(name: str) -> bool:
    parts = _parts(name)
    for i, part in enumerate(parts):
        qualified = i > 0 and parts[i - 1] in _IDENTIFIER_QUALIFIERS
        if any(s in part for s in _SECRET_SUBSTRINGS):
            return True
        if part in _SECRET_WORDS and not qualified:
            return True
    if len(parts) >= 2 and parts[-1] in ("key", "keys") and parts[-2] not in _IDENTIFIER_QUALIFIERS:
        return True
    return False


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        n = int(ch)
        if i % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def _named(match: re.Match[str]) -> str:
    name, glue, quote = match.group(1), match.group(2), match.group(3) or ""
    start = match.start()
    if start and match.string[start - 1] in "_-." and not name.lower().startswith(("pass", "secret")):
        # ``fencing_token=17``, ``idempotency-key: pl1-…``: an identifier, as the names rule says.
        before = _parts(match.string[max(0, start - 40):start - 1])
        if before and before[-1] in _IDENTIFIER_QUALIFIERS:
            return match.group(0)
    return f"{name}{glue}{quote}{MARK}{quote}"


def _card(match: re.Match[str]) -> str:
    digits = re.sub(r"[ -]", "", match.group(0))
    return MARK if 13 <= len(digits) <= 19 and _luhn(digits) else match.group(0)


#: Credentials this process holds whatever the action (OAuth client secrets, refresh and access
#: tokens, worker/oauth.py): scrubbed from every text like an action's own secrets. The newest kept.
#: A tuple replaced whole on each change, so that readers on other threads never see it change.
_PROCESS_SECRETS: tuple[str, ...] = ()
MAX_PROCESS_SECRETS = 256


def remember_secret(value: str) -> None:
    """Scrub ``value`` from every text this process redacts from now on."""
    global _PROCESS_SECRETS
    if len(value) < MIN_SECRET_LENGTH or value in _PROCESS_SECRETS:
        return
    _PROCESS_SECRETS = (value, *_PROCESS_SECRETS)[:MAX_PROCESS_SECRETS]


def scrub_text(text: str, secrets: Iterable[str] = ()) -> str:
    """Replace known secret values, card numbers, bearer credentials, PEM private keys, the password
    of a URL or DSN, a value free text names as a secret (``password=…``, ``the token is …``) and
    well-known credential shapes (AWS access key ids, GitHub and Slack tokens, JSON Web Tokens)."""
    held = _PROCESS_SECRETS
    if held:
        secrets = (*secrets, *held)
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, MARK)
    if len(text) < 8:  # too short for a card number or for "Bearer x"
        return text
    if "PRIVATE KEY-----" in text:
        text = _PEM.sub(MARK, text)
    low = text.lower()
    if "bearer" in low or "basic" in low:
        text = _BEARER.sub(lambda m: f"{m.group(1)}{m.group(2)}{MARK}", text)
    if "://" in text and "@" in text:
        text = _USERINFO.sub(lambda m: f"{m.group(1)}:{MARK}@", text)
    if any(word in low for word in _MAYBE_NAMED):
        text = _NAMED_SECRET.sub(_named, text)
    if any(shape in low for shape in _MAYBE_SHAPE):
        text = _SHAPES.sub(MARK, text)
    if _MAYBE_CARD.search(text):
        text = _CARD.sub(_card, text)
    return text


@dataclass(frozen=True)
class Redactor:
    """The policy plus one action's declared names and secret values."""

    #: Declared names, normalized (see :func:`normalize`).
    names: frozenset[str] = frozenset()
    #: Secret values to hunt for in any text, longest first.
    secrets: tuple[str, ...] = ()

    def is_sensitive(self, name: Any) -> bool:
        text = str(name)
        return _sensitive(text) or (bool(self.names) and "".join(_parts(text)) in self.names)

    def text(self, text: str) -> str:
        return scrub_text(text, self.secrets)

    def __call__(self, value: Any) -> Any:
        """A redacted copy of ``value`` (the original is never modified)."""
        if isinstance(value, Mapping):
            return {k: (MARK if self.is_sensitive(k) else self(v)) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self(v) for v in value]
        if isinstance(value, str):
            return self.text(value)
        return value

    def merged(self, other: Redactor) -> Redactor:
        return Redactor(self.names | other.names, _ordered((*self.secrets, *other.secrets)))


POLICY = Redactor()
#: The redactor of the action the current task handles: log records and Sentry events made while it
#: runs are scrubbed of that action's secret values too (worker/observability.py). Tasks set it first.
current_redactor: ContextVar[Redactor] = ContextVar("proofline_redactor", default=POLICY)


def _ordered(values: Iterable[str]) -> tuple[str, ...]:
    # Longest first, so a secret that contains another is replaced whole.
    return tuple(sorted({v for v in values if len(v) >= MIN_SECRET_LENGTH}, key=lambda v: (-len(v), v)))


def leaf_names(paths: Iterable[str]) -> list[str]:
    """``["args.note", "result.token"]`` → ``["note", "token"]`` (contract ``sensitive_fields``)."""
    return [str(p).rsplit(".", 1)[-1] for p in paths]


def _collect(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int | float):
        out.append(str(value))
    elif isinstance(value, Mapping):
        for v in value.values():
            _collect(v, out)
    elif isinstance(value, list | tuple):
        for v in value:
            _collect(v, out)


def _secret_values(value: Any, redactor: Redactor, out: list[str]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            if redactor.is_sensitive(k):
                _collect(v, out)
            else:
                _secret_values(v, redactor, out)
    elif isinstance(value, list | tuple):
        for v in value:
            _secret_values(v, redactor, out)


def for_names(fields: Iterable[Any] = ()) -> Redactor:
    return Redactor(frozenset(normalize(f) for f in fields if normalize(f)))


def for_envelope(envelope: Any, contract_fields: Iterable[str] = ()) -> Redactor:
    """The redactor for one action: the policy, the envelope's ``evidence.redact_fields``, the
    contract's ``sensitive_fields``, and the secret values its arguments carry under those names.

    Tolerates any input (a refused message is redacted with it too)."""
    names: list[Any] = leaf_names(contract_fields)
    env = envelope if isinstance(envelope, Mapping) else {}
    evidence = env.get("evidence")
    declared = evidence.get("redact_fields") if isinstance(evidence, Mapping) else None
    if isinstance(declared, list | tuple):
        names.extend(f for f in declared if isinstance(f, str))
    base = for_names(names)
    found: list[str] = []
    try:
        # The whole document, not only the arguments: a hostile envelope may hide a secret
        # anywhere, and its refusal text may quote it.
        _secret_values(env, base, found)
    except RecursionError:
        return base  # nested past what the interpreter follows: names and patterns still apply
    return Redactor(base.names, _ordered(found))


def for_message(message: Any, contract_fields: Iterable[str] = ()) -> Redactor:
    """The redactor for a message as it arrived (``{"envelope": …, …}``), whatever its shape."""
    env = message.get("envelope") if isinstance(message, Mapping) else None
    red = for_envelope(env, contract_fields)
    found: list[str] = []
    try:
        _secret_values(message, red, found)
    except RecursionError:
        return red
    return Redactor(red.names, _ordered((*red.secrets, *found)))


def as_redactor(value: Redactor | Iterable[str] | None) -> Redactor:
    """Store functions accept a redactor or, as before, an iterable of declared field names."""
    if isinstance(value, Redactor):
        return value
    return for_names(value or ())


def redact(value: Any, fields: Iterable[str] | Redactor = ()) -> Any:
    """A redacted copy of ``value`` under the policy plus the declared ``fields``."""
    return as_redactor(fields)(value)
