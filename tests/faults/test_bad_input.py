"""Bad input on the real publish path: malformed, truncated, oversized, wrongly typed, wrongly signed
and cross-tenant envelopes, put on the real ``actions`` queue and handled by real Celery workers.

What must hold for every one of them:

- it is refused with the reason code that names its damage, and the refusal is in the ledger: an
  ``envelope_refused`` event on the chain ``refusal_chain_id(message)`` (validation refusals), or the
  action's own chain closed ``not_started`` with ``tenant_mismatch`` (cross-tenant envelopes, which
  are correctly signed and only fail the contract's preconditions); a list nested deeper than the
  wire format reads (``worker/wire.py``, ``MAX_DEPTH``) is ``message_too_deep`` before it is decoded,
  on the chain of its body's digest;
- it causes no downstream effect, neither under any idempotency key it names nor anywhere else in
  the system of record;
- the workers keep serving good envelopes in between, and are all alive at the end.

The expected reason code of each kind of damage is derived from the order of the checks the
envelope specification states (size, then shape, then signature presence, key id, signature, schema,
argument hash, idempotency key, contract), never by running the validator.

Everything generated is JSON-representable, because Celery carries the message as JSON. Non-finite
floats and integers beyond 2**53 *are* representable in Python's JSON (``NaN``, ``Infinity``, big
literals survive the round trip) but not in RFC 8785 canonical JSON, which signatures are computed
over: they get their own damage kind, whose expected refusal is ``envelope_malformed``, and their
refusal chain id is computed the same way the worker does it (from ``repr`` of the message).

NUL characters are kept out of the text in claimed fields on purpose: a NUL in a field the refusal
record quotes exposes a product bug, pinned by its own test at the end of this file (the refusal
cannot be written, the task raises, Celery retries it and finally drops it, and the ledger never
hears of it). A non-ASCII signature used to do the same; its own test stays as a regression test.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, Phase, assume, event, example, given, settings
from hypothesis import strategies as st

from ledger.states import ActionStatus, Outcome
from proofline.canonical import canonical_bytes
from proofline.controller import publish_message
from proofline.envelope import derive_idempotency_key
from proofline.keys import KeyRole, SigningKey, load_keyring, load_signing_key
from proofline.signing import encode_signature
from proofline_kit.sor import store as sor
from tests.conftest import Stack, wait_for
from tests.helpers import LosingBroker
from worker import wire
from worker.validate import MAX_MESSAGE_BYTES, refusal_chain_id

MALFORMED = "envelope_malformed"
TOO_DEEP = "message_too_deep"  # refused by the wire format before decoding, on its body's digest
UNSIGNED = "envelope_unsigned"
UNKNOWN_KEY = "envelope_unknown_key"
BAD_SIGNATURE = "envelope_bad_signature"
HASH_MISMATCH = "envelope_argument_hash_mismatch"
KEY_MISMATCH = "envelope_idempotency_key_mismatch"
UNKNOWN_TYPE = "unknown_action_type"
CONTRACT_MISMATCH = "contract_mismatch"
TENANT_MISMATCH = "tenant_mismatch"

# Waits that end at the record; only a failure waits them out (a loaded host, parallel test
# workers, can take most of a minute to pick a message up).
REFUSAL_TIMEOUT = 90.0
GOOD_EVERY = 6

# --- JSON-only value strategies ----------------------------------------------------------------

SAFE_INT = st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
FINITE = st.floats(allow_nan=False, allow_infinity=False)
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=24)
ASCII_TEXT = st.text(st.characters(codec="ascii"), max_size=70)
# Dictionary keys: plain letters (kombu's JSON decoder gives keys like "__type__" a meaning).
KEY = st.text(string.ascii_lowercase, min_size=1, max_size=8)
SCALAR = st.none() | st.booleans() | SAFE_INT | FINITE | TEXT
JUNK = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEY, inner, max_size=4),
                    max_leaves=10)
FALSY = st.sampled_from([None, "", 0, 0.0, False, [], {}])
NON_STR = JUNK.filter(lambda v: not isinstance(v, str))
TRUTHY_NON_STR = NON_STR.filter(bool)
# Strings that no lax conversion turns into a number, bool, datetime or enum member.
XSTR = st.text(string.ascii_letters, max_size=10).map(lambda s: "x" + s)
LISTS = st.lists(JUNK, max_size=3)
DICTS = st.dictionaries(KEY, JUNK, max_size=3)
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf]) | st.integers(min_value=2**53, max_value=2**70).flatmap(
    lambda n: st.sampled_from([n, -n]))
TENANT = st.sampled_from(["acme", "globex"]) | st.text(string.ascii_lowercase + string.digits + "-", min_size=1,
                                                        max_size=30)

# --- the envelope's fields, with values that its schema v1 must reject -------------------------

NOT_A_STRING = st.none() | SAFE_INT | FINITE | st.booleans() | LISTS | DICTS
BAD_STRING = NOT_A_STRING | st.just("") | st.text(string.ascii_letters, min_size=201, max_size=240)
NOT_AN_INT = st.none() | LISTS | DICTS | XSTR | st.integers(-50, 50).map(lambda n: n + 0.5)
NOT_A_DATETIME = st.none() | LISTS | DICTS | XSTR | st.just("2030-01-01T00:00:00")  # no time zone
NOT_A_BOOL = st.none() | LISTS | DICTS | XSTR
NOT_A_MODEL = st.none() | SAFE_INT | XSTR | LISTS
NOT_A_NUMBER = st.none() | LISTS | DICTS | XSTR


def ints_outside(low: int | None, high: int | None) -> st.SearchStrategy[int]:
    options = []
    if low is not None:
        options.append(st.integers(low - 1000, low - 1))
    if high is not None:
        options.append(st.integers(high + 1, high + 1000))
    return st.one_of(options)


WRONG_VALUES: dict[tuple[str, ...], st.SearchStrategy[Any]] = {
    **{(name,): BAD_STRING for name in ("run_id", "action_id", "workflow_type", "action_type", "requester",
                                        "workload_identity", "tenant", "environment", "operation",
                                        "arguments_hash", "idempotency_key")},
    ("action_id",): BAD_STRING | st.sampled_from(["has space", "slash/inside", "semi;colon"]),
    ("operation",): BAD_STRING | st.sampled_from(["Create", " create", "REFUND"]),
    ("arguments_hash",): BAD_STRING | st.text("0123456789abcdef", min_size=63, max_size=63),
    ("target", "type"): BAD_STRING,
    ("target", "id"): BAD_STRING,
    ("server", "name"): BAD_STRING,
    ("server", "version"): BAD_STRING,
    ("tool", "name"): BAD_STRING,
    ("tool", "contract_hash"): BAD_STRING | st.text("ABCDEF0123456789", min_size=64, max_size=64).filter(
        lambda s: s != s.lower()),
    ("approval", "id"): BAD_STRING,
    ("schema_version",): st.none() | LISTS | XSTR | st.integers(2, 99) | st.integers(-99, 0),
    ("step",): NOT_AN_INT | ints_outside(0, None),
    ("run_steps",): NOT_AN_INT | ints_outside(1, 100),
    ("policy_version",): NOT_AN_INT | ints_outside(1, None),
    ("approval", "version"): NOT_AN_INT | ints_outside(1, None),
    ("authority_budget", "max_calls"): NOT_AN_INT | ints_outside(1, 20),
    ("retry_policy", "max_attempts"): NOT_AN_INT | ints_outside(1, 10),
    ("retry_policy", "retry_unknown_outcome"): st.just(True),
    ("timeout_seconds",): NOT_A_NUMBER | st.floats(-1e6, 0) | st.floats(3600.5, 1e9),
    ("retry_policy", "backoff_seconds"): NOT_A_NUMBER | st.floats(-1e6, -0.01) | st.floats(600.5, 1e9),
    ("deadline",): NOT_A_DATETIME,
    ("approval", "expires_at"): NOT_A_DATETIME,
    ("irreversible",): NOT_A_BOOL,
    ("approval", "covers_irreversible"): NOT_A_BOOL,
    ("evidence", "record_tool_result"): NOT_A_BOOL,
    ("cancellation",): XSTR | st.none() | SAFE_INT,
    ("preconditions",): st.none() | SAFE_INT | XSTR | st.lists(SAFE_INT, min_size=1, max_size=3),
    ("arguments",): st.none() | SAFE_INT | XSTR | LISTS,
    **{(name,): NOT_A_MODEL for name in ("target", "server", "tool", "approval", "authority_budget",
                                         "retry_policy", "evidence")},
}
REQUIRED = ["run_id", "action_id", "workflow_type", "action_type", "requester", "workload_identity", "tenant",
            "environment", "target", "operation", "arguments", "arguments_hash", "server", "tool",
            "policy_version", "approval", "idempotency_key", "timeout_seconds", "deadline"]
PATHS = sorted(WRONG_VALUES)
# Fields the idempotency key is derived from, with valid replacement values.
KEY_FIELDS: dict[tuple[str, ...], st.SearchStrategy[Any]] = {
    ("tenant",): TENANT,
    ("run_id",): st.text(string.ascii_letters + string.digits + "-", min_size=1, max_size=60),
    ("action_id",): st.text(string.ascii_letters + string.digits + "._:-", min_size=1, max_size=60),
    ("workflow_type",): st.text(string.ascii_lowercase + ".", min_size=1, max_size=30),
    ("target", "id"): st.text(string.ascii_letters + string.digits + "-", min_size=1, max_size=60),
    ("operation",): st.text(string.ascii_lowercase, min_size=1, max_size=20),
    ("approval", "version"): st.integers(1, 10_000),
    ("idempotency_key",): st.text(string.ascii_letters + string.digits + "-", min_size=1, max_size=200),
}


# --- helpers --------------------------------------------------------------------------------------


def get_path(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def set_path(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        doc = doc[part]
    doc[path[-1]] = value


def mac(secret: str, document: Any) -> str:
    """An Ed25519 signature over the RFC 8785 canonical JSON of the document (the signature spec), made
    with a key derived from ``secret``: any key but the real one."""
    seed = hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()
    return encode_signature(Ed25519PrivateKey.from_private_bytes(seed).sign(canonical_bytes(document)))


def same_json(a: Any, b: Any) -> bool:
    try:
        return canonical_bytes(a) == canonical_bytes(b)
    except Exception:  # noqa: BLE001 - not canonicalisable: compare the JSON text instead
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def size_of(message: Any) -> int:
    return len(json.dumps(message))


def salvage(text: str) -> Any:
    """Parse what is still valid of a truncated JSON text: the longest prefix that becomes valid JSON
    once an open string and the open containers are closed (a dangling comma is dropped)."""
    states: list[tuple[bool, str]] = [(False, "")]
    closers: list[str] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]":
            closers.pop()
        states.append((in_string, "".join(reversed(closers))))
    for cut in range(len(text), 0, -1):
        open_string, tail = states[cut]
        prefix = text[:cut]
        candidates = [prefix + '"' + tail] if open_string else [prefix + tail, prefix.rstrip().rstrip(",") + tail]
        for candidate in candidates:
            try:
                return json.loads(candidate)
            except ValueError:
                continue
    return None


@dataclass
class Ctx:
    """What an example needs from the running stack."""

    stack: Stack

    @property
    def key(self) -> SigningKey:
        return load_signing_key(self.stack.settings.signing_key_file, KeyRole.controller)

    @property
    def key_id(self) -> str:
        return self.key.key_id

    @property
    def known_key_ids(self) -> set[str]:
        return set(load_keyring(self.stack.settings.keyring_file).keys)

    def base(self, which: str) -> dict[str, Any]:
        """A fresh, correctly signed message for a ticket.create or a refund.issue."""
        if which == "ticket":
            env = ticket_envelope(self.stack, "acme", "acme")
        else:
            env = refund_envelope(self.stack, "acct-1", "acme", "acme", 1500)
        return self.stack.message(env)

    def sign(self, document: dict[str, Any]) -> dict[str, Any]:
        """Signed again with the real controller key."""
        return {"envelope": document, "key_id": self.key_id,
                "signature": encode_signature(self.key.sign(canonical_bytes(document)))}


def ticket_envelope(stack: Stack, tenant: str, args_tenant: str, title: str = "disk full"):
    return stack.envelope("ticket.create", tenant=tenant,
                          arguments={"tenant": args_tenant, "title": title, "owner": "ops"},
                          target={"type": "ticket_queue", "id": f"{tenant}-ops"})


def refund_envelope(stack: Stack, account: str, tenant: str, args_tenant: str, amount: int):
    version = sor.get_account(stack.sor_db, account)["account"]["version"]
    return stack.envelope("refund.issue", tenant=tenant,
                          arguments={"account": account, "tenant": args_tenant, "amount_cents": amount,
                                     "reason": "outage"},
                          target={"type": "account", "id": account, "expected_version": version})


@dataclass
class Sent:
    """One piece of bad input as delivered, and what must become of it."""

    message: Any
    expected: str
    #: Idempotency keys the input names or was derived from: none may ever see an effect.
    keys: set[str] = field(default_factory=set)
    #: Action ids the input claims: a validation refusal must leave their chains untouched.
    claimed: set[str] = field(default_factory=set)
    #: Set for correctly signed input that fails its preconditions: the action it opens.
    action_id: str | None = None


def sent(message: Any, expected: str, base: dict[str, Any] | None = None) -> Sent:
    keys, claimed = set(), set()
    for source in (base, message):
        env = source.get("envelope") if isinstance(source, dict) else None
        if isinstance(env, dict):
            if isinstance(env.get("idempotency_key"), str):
                keys.add(env["idempotency_key"])
            if isinstance(env.get("action_id"), str):
                claimed.add(env["action_id"])
    return Sent(message, expected, keys, claimed)


# --- the kinds of damage ---------------------------------------------------------------------------


@dataclass
class NotAnObject:
    """The message itself is not an object (a scalar, a list, a deeply nested list)."""

    value: Any

    def apply(self, ctx: Ctx) -> Sent:
        return sent(self.value, TOO_DEEP if nesting(self.value) + BODY_NESTING > wire.MAX_DEPTH else MALFORMED)


#: How deep the broker's body nests a delivered message: ``[[message], kwargs, embed]``.
BODY_NESTING = 2


def nesting(value: Any) -> int:
    """How deep lists and objects nest in ``value`` (a scalar is 0), without recursing."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in children)
    return deepest


@dataclass
class EnvelopeNotObject:
    """The message is an object, but its ``envelope`` is missing or not an object; signature intact."""

    base: str
    value: Any
    drop: bool

    def apply(self, ctx: Ctx) -> Sent:
        original = ctx.base(self.base)
        message = copy.deepcopy(original)
        if self.drop:
            del message["envelope"]
        else:
            message["envelope"] = self.value
        return sent(message, MALFORMED, original)


@dataclass
class Truncated:
    """The JSON text of a signed message cut short and re-parsed to whatever is still valid, or
    delivered as the bare truncated text."""

    base: str
    order: list[str]
    fraction: float
    as_text: bool

    def apply(self, ctx: Ctx) -> Sent:
        original = ctx.base(self.base)
        text = json.dumps({k: original[k] for k in self.order})
        cut = 1 + int(self.fraction * (len(text) - 2))  # at least "{", never the whole text
        if self.as_text:
            return sent(text[:cut], MALFORMED, original)
        message = salvage(text[:cut])
        assume(not same_json(message, original))  # cut only in the closing brackets: nothing lost
        if not isinstance(message, dict) or not isinstance(message.get("envelope"), dict):
            expected = MALFORMED
        elif not message.get("signature") or not message.get("key_id"):
            expected = UNSIGNED
        elif message["key_id"] != ctx.key_id:
            expected = UNKNOWN_KEY
        else:
            expected = BAD_SIGNATURE
        return sent(message, expected, original)


@dataclass
class SignatureFields:
    """``key_id`` or ``signature`` missing or replaced by a value of any JSON type."""

    base: str
    which: str
    value: Any
    drop: bool

    def apply(self, ctx: Ctx) -> Sent:
        original = ctx.base(self.base)
        message = copy.deepcopy(original)
        if self.drop:
            del message[self.which]
            return sent(message, UNSIGNED, original)
        assume(not same_json(self.value, original[self.which]))
        message[self.which] = self.value
        if not self.value:
            expected = UNSIGNED
        elif not isinstance(self.value, str):
            expected = MALFORMED
        elif self.which == "key_id" and self.value not in ctx.known_key_ids:
            expected = UNKNOWN_KEY
        else:
            expected = BAD_SIGNATURE
        return sent(message, expected, original)


@dataclass
class UnknownKey:
    """Signed under a key id the workers do not know (with a made-up secret, or the real signature)."""

    base: str
    key_id: str
    secret: str | None

    def apply(self, ctx: Ctx) -> Sent:
        assume(self.key_id not in ctx.known_key_ids)
        original = ctx.base(self.base)
        document = original["envelope"]
        signature = mac(self.secret, document) if self.secret is not None else original["signature"]
        return sent({"envelope": document, "key_id": self.key_id, "signature": signature}, UNKNOWN_KEY, original)


@dataclass
class WrongSignature:
    """The real key id, but a signature made with another key, random hex or the right signature upper-cased."""

    base: str
    how: str
    secret: str
    hex_digits: str

    def apply(self, ctx: Ctx) -> Sent:
        original = ctx.base(self.base)
        message = copy.deepcopy(original)
        if self.how == "secret":
            message["signature"] = mac(self.secret, message["envelope"])
        elif self.how == "hex":
            assume(self.hex_digits != original["signature"])
            message["signature"] = self.hex_digits
        else:
            message["signature"] = original["signature"].upper()
            assume(message["signature"] != original["signature"])
        return sent(message, BAD_SIGNATURE, original)


@dataclass
class Tampered:
    """One envelope field changed, removed or added after signing; not signed again."""

    base: str
    path: tuple[str, ...]
    how: str
    value: Any
    extra_key: str

    def apply(self, ctx: Ctx) -> Sent:
        original = ctx.base(self.base)
        message = copy.deepcopy(original)
        document = message["envelope"]
        if self.how == "replace":
            assume(not same_json(get_path(document, self.path), self.value))
            set_path(document, self.path, self.value)
        elif self.how == "delete":
            parent = get_path(document, self.path[:-1])
            del parent[self.path[-1]]
        else:
            parent = get_path(document, self.path[:-1])
            assume(isinstance(parent, dict) and self.extra_key not in parent)
            parent[self.extra_key] = self.value
        return sent(message, BAD_SIGNATURE, original)


@dataclass
class ResignedSchemaViolation:
    """A field given a value of the wrong type or out of range, a required field removed or an unknown
    field added, then signed again with the real key: refused by the schema."""

    base: str
    how: str
    path: tuple[str, ...]
    value: Any
    required: str
    extra_key: str
    extra_in: str

    def apply(self, ctx: Ctx) -> Sent:
        original = ctx.base(self.base)
        document = copy.deepcopy(original["envelope"])
        if self.how == "wrong":
            set_path(document, self.path, self.value)
        elif self.how == "missing":
            del document[self.required]
        else:
            parent = document if self.extra_in == "envelope" else document[self.extra_in]
            assume(self.extra_key not in parent)
            parent[self.extra_key] = self.value
        return sent(ctx.sign(document), MALFORMED, original)


@dataclass
class ArgumentsChanged:
    """Arguments (or the argument hash) changed and the envelope signed again with the real key,
    the argument hash not recomputed."""

    base: str
    how: str
    argument: str
    value: Any
    digest: str

    def apply(self, ctx: Ctx) -> Sent:
        original = ctx.base(self.base)
        document = copy.deepcopy(original["envelope"])
        if self.how == "argument":
            arguments = document["arguments"]
            assume(self.argument not in arguments or not same_json(arguments[self.argument], self.value))
            arguments[self.argument] = self.value
        else:
            assume(self.digest != document["arguments_hash"])
            document["arguments_hash"] = self.digest
        return sent(ctx.sign(document), HASH_MISMATCH, original)


@dataclass
class KeyMaterialChanged:
    """A field the idempotency key is derived from (or the key itself) changed and the envelope signed
    again with the real key, the key not recomputed."""

    base: str
    path: tuple[str, ...]
    value: Any

    def apply(self, ctx: Ctx) -> Sent:
        original = ctx.base(self.base)
        document = copy.deepcopy(original["envelope"])
        assume(not same_json(get_path(document, self.path), self.value))
        set_path(document, self.path, self.value)
        return sent(ctx.sign(document), KEY_MISMATCH, original)


@dataclass
class OffContract:
    """Correctly signed with a correct key, but naming an action type without a contract, or a tool,
    server, operation or target type its contract does not allow."""

    base: str
    what: str
    value: str

    def apply(self, ctx: Ctx) -> Sent:
        original = ctx.base(self.base)
        document = copy.deepcopy(original["envelope"])
        if self.what == "action_type":
            document["action_type"] = "nosuch." + self.value
            expected = UNKNOWN_TYPE
        else:
            path = {"tool": ("tool", "name"), "server": ("server", "name"), "operation": ("operation",),
                    "target_type": ("target", "type")}[self.what]
            assume(get_path(document, path) != self.value)
            set_path(document, path, self.value)
            expected = CONTRACT_MISMATCH
        document["idempotency_key"] = derive_idempotency_key(
            tenant=document["tenant"], workflow_type=document["workflow_type"], run_id=document["run_id"],
            action_id=document["action_id"], target_type=document["target"]["type"],
            target_id=document["target"]["id"], operation=document["operation"],
            argument_hash=document["arguments_hash"], approval_version=document["approval"]["version"])
        return sent(ctx.sign(document), expected, original)


@dataclass
class NotCanonical:
    """A NaN, an infinity or an integer beyond 2**53 (valid for Celery's JSON, not for the canonical
    JSON signatures are computed over) in the envelope, or in place of ``key_id`` or ``signature``."""

    base: str
    where: str
    path: tuple[str, ...]
    argument: str
    value: Any

    def apply(self, ctx: Ctx) -> Sent:
        original = ctx.base(self.base)
        message = copy.deepcopy(original)
        if self.where == "field":
            set_path(message["envelope"], self.path, self.value)
        elif self.where == "argument":
            message["envelope"]["arguments"][self.argument] = self.value
        else:
            message[self.where] = self.value
        return sent(message, MALFORMED, original)


@dataclass
class Oversized:
    """Just above ``MAX_MESSAGE_BYTES``: a fully valid, correctly signed ticket.create whose title is
    huge, a valid message with a huge extra top-level field, or a huge signature."""

    where: str
    excess: int
    pad: str

    def apply(self, ctx: Ctx) -> Sent:
        if self.where == "title":
            length = 0
            message = ctx.stack.message(ticket_envelope(ctx.stack, "acme", "acme", title=""))
            while size_of(message) != MAX_MESSAGE_BYTES + self.excess:  # ids and times may vary in length
                length += MAX_MESSAGE_BYTES + self.excess - size_of(message)
                message = ctx.stack.message(ticket_envelope(ctx.stack, "acme", "acme", title=self.pad * length))
        elif self.where == "extra":
            message = ctx.base("ticket")
            message["padding"] = ""
            message["padding"] = self.pad * (MAX_MESSAGE_BYTES - size_of(message) + self.excess)
        else:
            message = ctx.base("ticket")
            message["signature"] = ""
            message["signature"] = self.pad * (MAX_MESSAGE_BYTES - size_of(message) + self.excess)
        assert size_of(message) == MAX_MESSAGE_BYTES + self.excess
        return sent(message, MALFORMED)


@dataclass
class CrossTenant:
    """Correctly signed, but the arguments or the target belong to another tenant."""

    what: str
    tenant: str
    other: str
    amount: int

    def apply(self, ctx: Ctx) -> Sent:
        stack = ctx.stack
        if self.what == "refund_of_globex_account_by_acme":
            env = refund_envelope(stack, "acct-2", "acme", "acme", self.amount)
        elif self.what == "refund_of_acme_account_by_other":
            assume(self.tenant != "acme")
            env = refund_envelope(stack, "acct-1", self.tenant, self.tenant, self.amount)
        else:
            assume(self.tenant != self.other)
            env = ticket_envelope(stack, self.tenant, self.other)
        # Published by the controller (recorded, not sent): a worker refuses any action nobody published.
        message = stack.message(env)
        publish_message(stack.conn, LosingBroker(), message, env, settings=stack.settings)
        result = Sent(message, TENANT_MISMATCH, {env.idempotency_key}, {env.action_id})
        result.action_id = env.action_id
        return result


BASE = st.sampled_from(["ticket", "refund"])

DAMAGE = st.one_of(
    st.builds(NotAnObject, value=st.one_of(
        SCALAR, LISTS, st.integers(50, 200).map(lambda depth: json.loads("[" * depth + "]" * depth)))),
    st.builds(EnvelopeNotObject, base=BASE, value=NON_STR.filter(lambda v: not isinstance(v, dict)) | TEXT,
              drop=st.booleans()),
    st.builds(Truncated, base=BASE, order=st.permutations(["envelope", "key_id", "signature"]),
              fraction=st.floats(0, 1, exclude_max=True), as_text=st.booleans()),
    st.builds(SignatureFields, base=BASE, which=st.just("key_id"), value=FALSY | TRUTHY_NON_STR | TEXT,
              drop=st.booleans()),
    st.builds(SignatureFields, base=BASE, which=st.just("signature"),
              value=FALSY | TRUTHY_NON_STR | ASCII_TEXT | TEXT, drop=st.booleans()),
    st.builds(UnknownKey, base=BASE, key_id=TEXT.filter(bool), secret=st.none() | TEXT.filter(bool)),
    st.builds(WrongSignature, base=BASE, how=st.sampled_from(["secret", "hex", "upper"]),
              secret=TEXT.filter(bool), hex_digits=st.text("0123456789abcdef", min_size=64, max_size=64)),
    st.builds(Tampered, base=BASE, path=st.sampled_from(PATHS), how=st.sampled_from(["replace", "delete", "add"]),
              value=JUNK, extra_key=KEY),
    st.sampled_from(PATHS).flatmap(lambda path: st.builds(
        ResignedSchemaViolation, base=BASE, how=st.sampled_from(["wrong", "wrong", "missing", "extra"]),
        path=st.just(path), value=WRONG_VALUES[path], required=st.sampled_from(REQUIRED), extra_key=KEY,
        extra_in=st.sampled_from(["envelope", "target", "approval", "tool", "server"]))),
    st.builds(ArgumentsChanged, base=BASE, how=st.sampled_from(["argument", "digest"]),
              argument=st.sampled_from(["tenant", "title", "amount_cents", "account"]) | KEY, value=JUNK,
              digest=st.text("0123456789abcdef", min_size=64, max_size=64)),
    st.sampled_from(sorted(KEY_FIELDS)).flatmap(lambda path: st.builds(
        KeyMaterialChanged, base=BASE, path=st.just(path), value=KEY_FIELDS[path])),
    st.builds(OffContract, base=BASE, what=st.sampled_from(["action_type", "tool", "server", "operation",
                                                             "target_type"]),
              value=st.text(string.ascii_lowercase + "_", min_size=1, max_size=20)),
    st.builds(NotCanonical, base=BASE, where=st.sampled_from(["field", "argument", "key_id", "signature"]),
              path=st.sampled_from(PATHS), argument=KEY, value=NON_FINITE),
    st.builds(Oversized, where=st.sampled_from(["title", "extra", "signature"]), excess=st.integers(1, 4096),
              pad=st.sampled_from(list(string.ascii_letters + string.digits))),
    st.builds(CrossTenant, what=st.sampled_from(["refund_of_globex_account_by_acme",
                                                 "refund_of_acme_account_by_other", "ticket_args_other_tenant"]),
              tenant=TENANT, other=TENANT, amount=st.integers(1, 50_000)),
)


# --- observation -------------------------------------------------------------------------------


def refusal_evidence(stack: Stack, chain: str, task_id: str) -> dict[str, Any] | None:
    """The refusal of task ``task_id`` on ``chain``; with ``chain`` "refused:*", on any refusal
    chain (a body the wire format refused is on the digest of its bytes as the broker carried them)."""
    with stack.conn.cursor() as cur:
        cur.execute("SELECT evidence FROM ledger_events WHERE event = 'envelope_refused' AND evidence->>'task_id' = %s "
                    "AND (action_id = %s OR (%s = 'refused:*' AND action_id LIKE 'refused:%%'))",
                    (task_id, chain, chain))
        row = cur.fetchone()
    return row["evidence"] if row else None


def last_effect_seq(stack: Stack) -> int:
    return max((e["seq"] for e in sor.effects(stack.sor_db)), default=0)


def action_of_key(stack: Stack, key: str) -> str | None:
    with stack.conn.cursor() as cur:
        cur.execute("SELECT action_id FROM actions WHERE idempotency_key = %s", (key,))
        row = cur.fetchone()
    return row["action_id"] if row else None


def preview(message: Any) -> str:
    text = repr(message)
    return text if len(text) < 600 else text[:600] + f"... ({len(text)} chars)"


def good_ticket_is_served(stack: Stack, good: dict[str, str]) -> None:
    env = ticket_envelope(stack, "acme", "acme", title=f"good {uuid.uuid4().hex[:8]}")
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), (
        f"a good envelope between bad ones ended {row.status}/{row.outcome}/{row.reason_code}")
    assert stack.effects(env.idempotency_key) == 1
    good[env.idempotency_key] = env.action_id


def check_refused(stack: Stack, item: Sent, task_id: str) -> None:
    chain = "refused:*" if item.expected == TOO_DEEP else refusal_chain_id(item.message)
    evidence = wait_for(lambda: refusal_evidence(stack, chain, task_id), REFUSAL_TIMEOUT,
                        what=f"an envelope_refused record ({item.expected}) on {chain} for {preview(item.message)}; "
                             f"workers alive: {stack.workers_alive()}")
    assert evidence["reason_code"] == item.expected, (
        f"refused as {evidence['reason_code']} ({evidence.get('detail')}), expected {item.expected}, "
        f"for {preview(item.message)}")
    for action_id in item.claimed:
        # A refused message writes only to its own chain, never into the action it claims to be.
        assert stack.action(action_id) is None
        assert stack.events(action_id) == []


def check_tenant_mismatch(stack: Stack, item: Sent) -> None:
    assert item.action_id is not None
    row = stack.wait_settled(item.action_id, timeout=REFUSAL_TIMEOUT)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.not_started,
                                                          TENANT_MISMATCH), preview(item.message)
    timeline = stack.timeline(item.action_id)
    failed = [e["evidence"] for e in timeline if e["event"] == "preconditions_failed"]
    assert len(failed) == 1 and failed[0]["failures"][0]["reason"] == TENANT_MISMATCH
    assert "tool_called" not in [e["event"] for e in timeline]


# --- the tests -------------------------------------------------------------------------------------

#: No shrinking: every failing attempt waits out a bounded timeout on the real stack, and the damage
#: objects Hypothesis prints are already small and readable.
NO_SHRINK = (Phase.explicit, Phase.generate)
HEALTH = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much]


def test_bad_input_is_refused_recorded_and_harmless(stack: Stack) -> None:
    baseline = last_effect_seq(stack)
    good: dict[str, str] = {}  # idempotency key -> action id of each good envelope served
    bad_keys: set[str] = set()
    mine: set[str] = set()  # every action id this test made or claimed
    examples = itertools.count()

    @settings(max_examples=60, deadline=None, database=None, phases=NO_SHRINK, suppress_health_check=HEALTH)
    @given(damage=DAMAGE)
    # Either side of the wire format's depth limit, every run (a random draw meets them only sometimes).
    @example(damage=NotAnObject(json.loads("[" * (wire.MAX_DEPTH - BODY_NESTING) + "]" * (wire.MAX_DEPTH - BODY_NESTING))))
    @example(damage=NotAnObject(json.loads("[" * (wire.MAX_DEPTH - 1) + "]" * (wire.MAX_DEPTH - 1))))
    def bad_input(damage: Any) -> None:
        if next(examples) % GOOD_EVERY == 0:
            good_ticket_is_served(stack, good)
            mine.update(good.values())
        item = damage.apply(Ctx(stack))
        event(f"{type(damage).__name__} -> {item.expected}")
        bad_keys.update(item.keys)
        mine.update(item.claimed)
        task_id = stack.deliver(item.message)
        if item.action_id is None:
            check_refused(stack, item, task_id)
        else:
            check_tenant_mismatch(stack, item)
        for key in item.keys:
            assert stack.effects(key) == 0, f"bad input made an effect under {key}: {preview(item.message)}"
        assert stack.workers_alive()

    bad_input()
    good_ticket_is_served(stack, good)  # still serving after the last bad one
    mine.update(good.values())

    assert stack.workers_alive()
    new = [e for e in sor.effects(stack.sor_db) if e["seq"] > baseline]
    ours = [e for e in new if e["idempotency_key"] in good]
    assert sorted(e["idempotency_key"] for e in ours) == sorted(good), "each good envelope: exactly one effect"
    assert not [e for e in new if e["idempotency_key"] in bad_keys]
    # Anything else the system of record applied meanwhile must belong to some other test's action
    # still in flight, never to input from this one.
    unexplained = [e for e in new if e["idempotency_key"] not in good
                   and (e["idempotency_key"] is None or action_of_key(stack, e["idempotency_key"]) in mine
                        or action_of_key(stack, e["idempotency_key"]) is None)]
    assert unexplained == [], f"effects not explained by good input: {unexplained}"


# The worker's own retries of a crashing task span about 10 s (5 x 2 s); the wait ends at the record.
BUG_TIMEOUT = 90.0


def deliver_and_expect_refusal(stack: Stack, item: Sent, accepted: set[str]) -> None:
    task_id = stack.deliver(item.message)
    chain = refusal_chain_id(item.message)
    evidence = wait_for(lambda: refusal_evidence(stack, chain, task_id), BUG_TIMEOUT,
                        what=f"an envelope_refused record on {chain} for {preview(item.message)}")
    assert evidence["reason_code"] in accepted, evidence
    for key in item.keys:
        assert stack.effects(key) == 0
    assert stack.workers_alive()


def test_non_ascii_signature_is_refused_with_a_record(stack: Stack) -> None:
    """Regression: ``verify`` used to hand a non-ASCII ``str`` signature to ``hmac.compare_digest``,
    which raises ``TypeError`` instead of returning False; the task failed, Celery retried it five
    times and dropped it, and no refusal reached the ledger. Such a signature cannot match a hex
    digest, so it is a bad signature (or, arguably, malformed); either code is accepted, a missing
    record is not."""

    @settings(max_examples=5, deadline=None, database=None, phases=NO_SHRINK, suppress_health_check=HEALTH)
    @example(base="ticket", signature="\x89")
    @given(base=BASE, signature=st.text(min_size=1, max_size=70).filter(lambda s: not s.isascii()))
    def non_ascii_signature(base: str, signature: str) -> None:
        original = Ctx(stack).base(base)
        message = dict(original, signature=signature)
        deliver_and_expect_refusal(stack, sent(message, BAD_SIGNATURE, original), {BAD_SIGNATURE, MALFORMED})

    non_ascii_signature()


def test_nul_in_a_claimed_field_is_refused_with_a_record(stack: Stack) -> None:
    """Product bug: a refusal's evidence quotes the message's claimed ``action_id``, ``run_id``,
    ``tenant`` and ``action_type`` as plain strings (``claimed_fields``); Postgres ``jsonb`` cannot
    hold U+0000, so writing the ``envelope_refused`` event fails, the task is retried and dropped, and
    a tampered message leaves no ledger record. The envelope here is tampered after signing, so the
    refusal it must get is a bad signature."""

    @settings(max_examples=5, deadline=None, database=None, phases=NO_SHRINK, suppress_health_check=HEALTH)
    @example(base="ticket", claimed="tenant", value="acme\x00")
    @given(base=BASE, claimed=st.sampled_from(["action_id", "run_id", "tenant", "action_type"]),
           value=st.tuples(TEXT, TEXT).map(lambda parts: parts[0] + "\x00" + parts[1]))
    def nul_in_claimed_field(base: str, claimed: str, value: str) -> None:
        original = Ctx(stack).base(base)
        message = copy.deepcopy(original)
        message["envelope"][claimed] = value
        deliver_and_expect_refusal(stack, sent(message, BAD_SIGNATURE, original), {BAD_SIGNATURE})

    nul_in_claimed_field()
