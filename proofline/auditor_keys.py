"""The auditor's X25519 key pair: the one key that opens the protected evidence store.

Workers seal what a contract's ``evidence_capture`` policy captures to the auditor's *public* key
(:mod:`proofline.vault`); only the holder of the private key reads it back. So a worker can write
captures and never read them, and the key that reads them never sits on a worker host.

Formats (JSON):

- ``auditor.key`` (0600, the auditor's folder only): ``{"key_id", "role": "auditor",
  "private_key": base64(raw 32-byte X25519 private key)}``
- ``auditor.pub`` (0644, given to every worker): ``{"key_id", "role": "auditor",
  "public_key": base64(raw 32 bytes)}``

A ``--development`` pair carries ``"development": true`` in both files; a production process
refuses it, as it refuses every development key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from proofline import keys
from proofline.errors import AuditorKeyRequired, ConfigurationError, EvidenceCaptureUnavailable

ROLE = "auditor"
PRIVATE_FILE = "auditor.key"
PUBLIC_FILE = "auditor.pub"


@dataclass(frozen=True)
class AuditorPublicKey:
    """What a worker holds: enough to seal, nothing to open."""

    key_id: str
    public: X25519PublicKey

    def raw(self) -> bytes:
        return self.public.public_bytes(Encoding.Raw, PublicFormat.Raw)


@dataclass(frozen=True)
class AuditorKey:
    """What only the auditor holds."""

    key_id: str
    private: X25519PrivateKey

    @property
    def public(self) -> AuditorPublicKey:
        return AuditorPublicKey(self.key_id, self.private.public_key())


def _checked(data: dict[str, Any], path: Path, environment: str) -> str:
    if data.get("role") != ROLE:
        raise ConfigurationError(f"{path}: role is {data.get('role')!r}, expected {ROLE!r}")
    if data.get("development", False) is True and environment == keys.PRODUCTION:
        raise ConfigurationError(f"{path} is a development auditor key; a production process refuses it")
    return keys._key_id(data.get("key_id"), path)


def read_public(path: Path, environment: str = "development") -> AuditorPublicKey:
    data = keys._read_json(path, "auditor public key")
    key_id = _checked(data, path, environment)
    return AuditorPublicKey(key_id, X25519PublicKey.from_public_bytes(
        keys._b64_32(data.get("public_key"), "public_key", path)))


def read_private(path: Path, environment: str = "development") -> AuditorKey:
    data = keys._read_json(path, "auditor key file")
    keys._private_file_mode_ok(path)
    key_id = _checked(data, path, environment)
    return AuditorKey(key_id, X25519PrivateKey.from_private_bytes(
        keys._b64_32(data.get("private_key"), "private_key", path)))


def public_path(settings: Any) -> Path | None:
    """Where this process finds the auditor's public key: the setting, else ``keys_dir/auditor.pub``."""
    if settings.auditor_public_key_file is not None:
        return Path(settings.auditor_public_key_file)
    return Path(settings.keys_dir) / PUBLIC_FILE if settings.keys_dir else None


def load_public(settings: Any) -> AuditorPublicKey:
    """The auditor public key a worker seals captures to, or :class:`EvidenceCaptureUnavailable`."""
    path = public_path(settings)
    if path is None:
        raise EvidenceCaptureUnavailable("no auditor public key is configured (PROOFLINE_AUDITOR_PUBLIC_KEY_FILE)")
    try:
        return keys._cached(path, "auditor public key", settings.environment,
                            lambda: read_public(path, settings.environment))
    except ConfigurationError as exc:
        raise EvidenceCaptureUnavailable(f"the auditor public key cannot be used: {exc.detail}",
                                         path=str(path)) from None


def load_private(settings: Any) -> AuditorKey:
    """The auditor's private key (the auditor's CLI and console), or :class:`AuditorKeyRequired`."""
    path = settings.auditor_key_file
    if path is None:
        raise AuditorKeyRequired("reading captured evidence needs the auditor's private key: set "
                                 "PROOFLINE_AUDITOR_KEY_FILE (only the auditor holds it)")
    try:
        return keys._cached(Path(path), "auditor key", settings.environment,
                            lambda: read_private(Path(path), settings.environment))
    except ConfigurationError as exc:
        raise AuditorKeyRequired(f"the auditor key cannot be used: {exc.detail}", path=str(path)) from None


def new_pair(development: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(private file content, public file content) of a fresh auditor key pair."""
    private = X25519PrivateKey.generate()
    key_id = keys.new_key_id(ROLE)
    raw = private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    key_file: dict[str, Any] = {"key_id": key_id, "role": ROLE, "private_key": keys._b64(raw)}
    pub_file: dict[str, Any] = {"key_id": key_id, "role": ROLE, "public_key": keys._b64(public)}
    if development:
        key_file["development"] = pub_file["development"] = True
    return key_file, pub_file


def write_pair(private_path: Path, public_path: Path, *, development: bool = False, force: bool = False) -> str:
    """Write a new auditor pair: the private file 0600 (its folder 0700), the public file 0644.
    Refuses to overwrite an auditor key unless ``force``: captures sealed to it would be lost."""
    private_path, public_path = Path(private_path), Path(public_path)
    if private_path.exists() and not force:
        raise ConfigurationError(f"{private_path} already exists; an auditor key is never overwritten (the "
                                 "captures sealed to it could no longer be read)")
    key_file, pub_file = new_pair(development)
    private_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    public_path.parent.mkdir(parents=True, exist_ok=True)
    # Private first: a public key whose private half was never written would seal unreadable captures.
    keys._write(private_path, key_file, 0o600)
    keys._write(public_path, pub_file, 0o644)
    return str(key_file["key_id"])


def readable_by_this_process(settings: Any) -> Path | None:
    """The auditor private key file this process could read, if any (an execute worker must not)."""
    candidates = [settings.auditor_key_file]
    if settings.keys_dir:
        candidates.append(Path(settings.keys_dir) / PRIVATE_FILE)
    for path in candidates:
        if path is not None and Path(path).is_file() and os.access(path, os.R_OK):
            return Path(path)
    return None
