"""Damage for the fuzz campaign (ops/fuzz.py): hostile values, damaged envelopes, damaged raw
messages. Seeded, so a failing case can be regenerated from its seed and index."""

from __future__ import annotations

import copy
import json
import pickle
import random
from dataclasses import dataclass
from typing import Any

from worker import wire


class HostileRepr:
    """An object whose ``repr`` and ``str`` raise: refusal evidence must not depend on them."""

    def __repr__(self) -> str:
        raise RuntimeError("repr refused")

    __str__ = __repr__


def nested(depth: int, leaf: Any = 0, kind: str = "list") -> Any:
    value = leaf
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


def self_referencing() -> list[Any]:
    loop: list[Any] = ["loop"]
    loop.append(loop)
    return loop


def hostile_value(rng: random.Random, json_only: bool) -> Any:
    """One value a hostile or broken producer could put anywhere in a message."""
    choices = [
        lambda: nested(rng.randint(65, 3000), kind=rng.choice(["list", "dict"])),
        lambda: "x" + chr(rng.randint(0xD800, 0xDFFF)) + "y",
        lambda: "nul\x00" * rng.randint(1, 4),
        lambda: chr(rng.randint(0xD800, 0xDBFF)) + "\x00" + chr(rng.randint(0xDC00, 0xDFFF)),
        lambda: 10 ** rng.randint(20, 6000),
        lambda: -(10 ** rng.randint(20, 6000)),
        lambda: float(rng.choice(["nan", "inf", "-inf"])),
        lambda: "y" * rng.randint(1000, 400_000),
        lambda: {"": None, "\ud800": "\x00"},
        lambda: [None] * rng.randint(0, 5000),
        lambda: rng.choice([None, True, False, 0, -1, 2**63, 1.5e308, "", [], {}]),
        lambda: "\u202e\ufeff\U0010ffff" * 5,
    ]
    if not json_only:
        choices += [
            self_referencing,
            HostileRepr,
            lambda: b"\xff\xfe\x00raw",
            lambda: {1: "int key", (1, 2): "tuple key", None: "none key"},
            lambda: {nested(5, kind="list").__class__: 1},
            lambda: object(),
        ]
    return rng.choice(choices)()


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict) and len(prefix) < 4:  # the envelope's own structure, not a hostile value's
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    return out


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


def damaged_message(rng: random.Random, good: dict[str, Any], json_only: bool) -> Any:
    """A signed message with one to three damages: hostile values at random places, removed or
    retyped fields, a damaged signature or key id, or no message at all."""
    message = copy.deepcopy(good)
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        paths = _paths(message) if isinstance(message, dict) else [()]
        path = rng.choice(paths)
        if kind < 0.65:
            message = _set(message, path, hostile_value(rng, json_only))
        elif kind < 0.75 and path:
            parent = message
            for key in path[:-1]:
                parent = parent[key]
            parent.pop(path[-1], None)
        elif kind < 0.85 and isinstance(message, dict):
            message["signature"] = rng.choice(["", "0" * 64, "\udcff" * 64, "é" * 64, None, 7])
        elif kind < 0.9 and isinstance(message, dict):
            message["key_id"] = rng.choice(["", "nope", "\x00", None, ["dev-1"], "dev-1" * 100])
        else:
            message = rng.choice([None, 0, "envelope", [], [good], {"envelope": "x"}, {"args": [], "kwargs": {}}])
    return message


@dataclass
class RawMessage:
    """A message as it would sit on the broker: body bytes, content type, extra headers."""

    body: bytes
    content_type: str
    headers: dict[str, Any]
    task: str = "proofline.execute"
    #: When set, pushed onto the queue's Redis list as is, instead of the body through kombu.
    document: bytes | None = None


def raw_message(rng: random.Random, good: dict[str, Any], nonce: str) -> RawMessage:
    """A damaged message for the real broker; every body is unique (the nonce) so that its record
    can be found by digest even when its headers lose the task id."""
    message = damaged_message(rng, good, json_only=True)
    if isinstance(message, dict):
        message["fuzz_nonce"] = nonce
    else:
        message = [message, nonce]
    roll = rng.random()
    headers: dict[str, Any] = {}
    task = "proofline.execute"
    try:
        body = wire.dumps([[message], {}, {}]).encode()
    except (ValueError, RecursionError):
        body = b'[["unencodable", "' + nonce.encode() + b'"], {}, {}]'
    content_type = wire.CONTENT_TYPE
    if roll < 0.08:
        content_type = rng.choice(["application/json", "application/x-python-serialize", "application/data",
                                   "text/plain", "application/x-yaml", ""])
        if content_type == "application/x-python-serialize":
            body = pickle.dumps((["pickled", nonce], {}, {}))
    elif roll < 0.16:
        cut = rng.randint(0, max(0, len(body) - 1))
        body = body[:cut] + bytes([rng.randint(0, 255)]) + nonce.encode() + body[cut + 1:]
    elif roll < 0.2:
        body = b"[[" + b"[" * 940 + nonce.encode().join([b"", b""]) + b"]" * 940 + b"],{},{}]"
    elif roll < 0.24:
        headers = rng.choice([{"timelimit": [0.001, 0.001]}, {"eta": "not a date"}, {"expires": "never"},
                              {"x": nested(300)}, {"retries": "many"}, {"id": None}, {"id": "\x00" * 300}])
    elif roll < 0.27:
        task = rng.choice(["proofline.verify", "proofline.recover", "proofline.nope", "celery.ping"])
    elif roll < 0.3:
        body = json.dumps({"task": "proofline.execute", "args": [nonce]}).encode()
    elif roll < 0.35:
        document = rng.choice([
            nonce.encode() + b" \xff not json",
            json.dumps({"body": nonce}).encode(),
            b"[" * 3000 + nonce.encode() + b"]" * 3000,
            json.dumps({"body": "!!" + nonce, "properties": {"delivery_tag": nonce, "body_encoding": "base64"}}).encode(),
            json.dumps({"body": nonce, "properties": {"delivery_tag": 5}, "headers": [nonce]}).encode(),
        ])
        return RawMessage(body, content_type, headers, task, document=document)
    return RawMessage(body, content_type, headers, task)
