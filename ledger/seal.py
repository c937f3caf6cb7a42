"""Sealed signed messages: the exact bytes a controller signed, stored AES-256-GCM encrypted.

``actions.envelope`` holds a redacted copy; the reconciler and recovery need the original to send
it again with its signature, so it is kept in ``actions.sealed_message``: the RFC 8785 canonical
bytes of the signed message (a NUL in an argument survives: bytea has no text rules), encrypted
with the key in ``seal.key`` and bound to its action id as associated data (a sealed message
copied onto another action's row does not open).

Blob layout: ``b"PLS1"``, one byte key id length, the key id (UTF-8), a 12-byte nonce, then the
ciphertext with its 16-byte tag. The key id in the header picks the key, so keys can rotate: old
keys stay loadable for reading while new rows are sealed with the current one.

The key file is ``{"key_id": str, "key": base64(32 bytes)}``, mode 0600 (``Settings.seal_key_file``,
default ``keys_dir/seal.key``). A key file readable by group or others is refused.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import stat
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from proofline.canonical import canonical_bytes
from proofline.errors import ConfigurationError, SealedMessageUnreadable
from proofline.settings import Settings, get_settings

MAGIC = b"PLS1"
NONCE_BYTES = 12
_AAD = b"proofline/sealed-message/v1\x00"


@dataclass(frozen=True)
class SealKey:
    key_id: str
    key: bytes = field(repr=False)

    def seal(self, action_id: str, plaintext: bytes) -> bytes:
        header = MAGIC + struct.pack("B", len(self.key_id.encode())) + self.key_id.encode()
        nonce = os.urandom(NONCE_BYTES)
        return header + nonce + AESGCM(self.key).encrypt(nonce, plaintext, _AAD + header + action_id.encode())


def load_key(path: Path) -> SealKey:
    """Read a seal key file; refuse one others can read, or one of the wrong shape."""
    try:
        mode = path.stat().st_mode
        raw = json.loads(path.read_text())
        key = base64.b64decode(raw["key"], validate=True)
        key_id = str(raw["key_id"])
    except FileNotFoundError as exc:
        raise ConfigurationError(f"seal key file {path} does not exist") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigurationError(f"seal key file {path} is not {{'key_id': str, 'key': base64}}: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigurationError(f"seal key file {path} is readable by group or others (chmod 600)")
    if len(key) != 32 or not key_id or len(key_id.encode()) > 255:
        raise ConfigurationError(f"seal key file {path}: need a 32-byte key and a key id of 1-255 bytes")
    return SealKey(key_id, key)


def write_key(path: Path, key_id: str | None = None) -> SealKey:
    """Create a new seal key file (mode 0600). For development and tests; ``proofline keys
    generate`` makes the deployment's."""
    key = SealKey(key_id or f"seal-{secrets.token_hex(6)}", os.urandom(32))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"key_id": key.key_id, "key": base64.b64encode(key.key).decode()}, handle)
    return key


# Keys this process has loaded, by key id: what opens sealed rows (a rotated-out key still reads).
_KEYS: dict[str, SealKey] = {}
_BY_PATH: dict[Path, SealKey] = {}
_LOCK = threading.Lock()


def remember(key: SealKey) -> SealKey:
    """Make ``key`` available for opening rows in this process (a key loaded some other way)."""
    with _LOCK:
        _KEYS[key.key_id] = key
    return key


def key_file(settings: Settings) -> Path:
    path = settings.seal_key_file
    if path is None:
        raise ConfigurationError("no seal key: set PROOFLINE_SEAL_KEY_FILE or PROOFLINE_KEYS_DIR "
                                 "(a signed message is never stored in the clear)")
    return Path(path)


def sealer_for(settings: Settings) -> SealKey:
    """The key new rows are sealed with (loaded once per file, and remembered for opening)."""
    path = key_file(settings).resolve()
    with _LOCK:
        key = _BY_PATH.get(path)
        if key is None:
            key = load_key(path)
            _BY_PATH[path] = key
            _KEYS[key.key_id] = key
    return key


def seal_message(key: SealKey, action_id: str, message: Any) -> bytes:
    """Seal a signed message as its canonical bytes."""
    return key.seal(action_id, canonical_bytes(message))


def open_bytes(action_id: str, blob: bytes) -> bytes:
    """The canonical bytes sealed for ``action_id``; raise :class:`SealedMessageUnreadable`."""
    blob = bytes(blob)
    if len(blob) < 6 or blob[:4] != MAGIC:
        raise SealedMessageUnreadable(f"sealed message of {action_id} has no seal header", action_id=action_id)
    n = blob[4]
    header, rest = blob[:5 + n], blob[5 + n:]
    key_id = header[5:].decode(errors="replace")
    key = _KEYS.get(key_id)
    if key is None:
        configured = get_settings().seal_key_file
        if configured is not None:
            sealer_for(get_settings())
        key = _KEYS.get(key_id)
    if key is None:
        raise SealedMessageUnreadable(f"no seal key {key_id!r} loaded to open the message of {action_id}",
                                      action_id=action_id, key_id=key_id)
    try:
        return AESGCM(key.key).decrypt(rest[:NONCE_BYTES], rest[NONCE_BYTES:], _AAD + header + action_id.encode())
    except InvalidTag:
        raise SealedMessageUnreadable(f"sealed message of {action_id} fails authentication (tampered, moved "
                                      "to another action, or another key)", action_id=action_id) from None


def open_message(action_id: str, blob: bytes) -> dict[str, Any]:
    return json.loads(open_bytes(action_id, blob))
