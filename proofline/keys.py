"""Key files: Ed25519 private keys for the processes that sign, a keyring of public keys for every
process that verifies, and the one command that makes them all (``proofline keys generate``).

Formats (JSON; private files are written 0600):

- ``controller.key`` / ``recovery.key`` / ``ledger.key`` / ``worker.key``:
  ``{"key_id", "role", "private_key": base64(raw 32-byte Ed25519 seed)}``
- ``seal.key``: ``{"key_id", "key": base64(32 random bytes)}`` (AES-256-GCM, used by the sealing code)
- ``keyring.json``: ``{"keys": [{"key_id", "role", "public_key": base64(raw 32 bytes),
  "not_after": ISO-8601 or null, "revoked": bool}]}``

A generated development key (``--development``) carries ``"development": true`` in its file and in
its keyring entry; a production process refuses it. Loaded files are cached by (path, mtime, size),
so a keyring edited for rotation or revocation takes effect without a restart.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import Enum
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from proofline.errors import ConfigurationError
from proofline.settings import Environment

#: The one environment where development keys are refused: the enum member, never a spelling of it.
PRODUCTION = Environment.production
FILES = {"controller": "controller.key", "recovery": "recovery.key", "ledger": "ledger.key", "worker": "worker.key"}
SEAL_FILE = "seal.key"
KEYRING_FILE = "keyring.json"


class KeyRole(str, Enum):
    """What a key may sign; each role signs one kind of statement and nothing else."""

    #: Fresh actions: "I request this" (never "this was approved").
    controller = "controller"
    #: Derived recovery envelopes (compensation, rollback, forward fix) with a parent link.
    recovery = "recovery"
    #: Ledger checkpoints.
    ledger = "ledger"
    #: Approvals, revocations and authority policies: held by people or an approval service, never by
    #: workers, controllers' automation or recovery. Its keyring entry names the approver (``identity``).
    approver = "approver"
    #: Evidence statements of what a worker recorded (one key per worker host or process); never an
    #: envelope, an approval or a checkpoint.
    worker = "worker"


@dataclass(frozen=True)
class SigningKey:
    key_id: str
    role: KeyRole
    private: Ed25519PrivateKey
    development: bool = False

    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)

    def public_bytes(self) -> bytes:
        return self.private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @property
    def public(self) -> Ed25519PublicKey:
        return self.private.public_key()


@dataclass(frozen=True)
class PublicKey:
    key_id: str
    role: KeyRole
    public: Ed25519PublicKey
    not_after: datetime | None = None
    revoked: bool = False
    development: bool = False
    #: Who holds the key (an approver's identity); two approvals count twice only with two identities.
    identity: str | None = None

    def expired(self, now: datetime) -> bool:
        return self.not_after is not None and now >= self.not_after


@dataclass(frozen=True)
class Keyring:
    keys: dict[str, PublicKey]

    def get(self, key_id: str) -> PublicKey | None:
        return self.keys.get(key_id)


# --- reading ---------------------------------------------------------------------------------------


def _b64_32(value: Any, what: str, path: Path) -> bytes:
    if not isinstance(value, str):
        raise ConfigurationError(f"{path}: {what} must be a base64 string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConfigurationError(f"{path}: {what} is not valid base64") from exc
    if len(raw) != 32:
        raise ConfigurationError(f"{path}: {what} must decode to 32 bytes, not {len(raw)}")
    return raw


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigurationError(f"{what} {path} does not exist (run `proofline keys generate --dir DIR` "
                                 "and set PROOFLINE_KEYS_DIR)") from None
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"{what} {path} cannot be read as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigurationError(f"{what} {path} must hold a JSON object")
    return data


def _key_id(value: Any, path: Path) -> str:
    if not isinstance(value, str) or not value or len(value) > 100:
        raise ConfigurationError(f"{path}: key_id must be a non-empty string of at most 100 characters")
    return value


def _private_file_mode_ok(path: Path) -> None:
    # Like ssh: a private key others can read is treated as already disclosed.
    mode = Path(path).stat().st_mode
    if mode & 0o077:
        raise ConfigurationError(f"{path} is readable by group or others (mode {oct(mode & 0o777)}); "
                                 "private key files must be 0600")


def read_signing_key(path: Path, role: KeyRole, environment: str = "development") -> SigningKey:
    """A private key file of the given role, refused when malformed, shared, of another role, or a
    development key in production."""
    data = _read_json(path, f"{role.value} key file")
    _private_file_mode_ok(path)
    if data.get("role") != role.value:
        raise ConfigurationError(f"{path}: role is {data.get('role')!r}, expected {role.value!r}")
    seed = _b64_32(data.get("private_key"), "private_key", path)
    development = data.get("development", False) is True
    if development and environment == PRODUCTION:
        raise ConfigurationError(f"{path} is a development key; a production process refuses it "
                                 "(generate keys without --development)")
    return SigningKey(_key_id(data.get("key_id"), path), role, Ed25519PrivateKey.from_private_bytes(seed),
                      development)


def _not_after(value: Any, path: Path, key_id: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigurationError(f"{path}: not_after of {key_id} must be an ISO-8601 string or null")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError as exc:
        raise ConfigurationError(f"{path}: not_after of {key_id} is not ISO-8601: {value!r}") from exc
    if moment.tzinfo is None:
        raise ConfigurationError(f"{path}: not_after of {key_id} must carry a time zone")
    return moment


def parse_keyring(data: dict[str, Any], path: Path, environment: str = "development") -> Keyring:
    entries = data.get("keys")
    if not isinstance(entries, list):
        raise ConfigurationError(f"{path}: a keyring is {{\"keys\": [...]}}")
    keys: dict[str, PublicKey] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise ConfigurationError(f"{path}: every keyring entry is an object")
        key_id = _key_id(entry.get("key_id"), path)
        if key_id in keys:
            raise ConfigurationError(f"{path}: key id {key_id} appears twice")
        try:
            role = KeyRole(entry.get("role"))
        except ValueError:
            raise ConfigurationError(f"{path}: {key_id} has unknown role {entry.get('role')!r}") from None
        revoked = entry.get("revoked", False)
        if not isinstance(revoked, bool):
            raise ConfigurationError(f"{path}: revoked of {key_id} must be true or false")
        development = entry.get("development", False) is True
        if development and not revoked and environment == PRODUCTION:
            raise ConfigurationError(f"{path}: {key_id} is a development key; a production process refuses "
                                     "a keyring that accepts it (revoke or remove it)")
        public = Ed25519PublicKey.from_public_bytes(_b64_32(entry.get("public_key"), f"public_key of {key_id}", path))
        identity = entry.get("identity")
        if identity is not None and (not isinstance(identity, str) or not identity or len(identity) > 200):
            raise ConfigurationError(f"{path}: identity of {key_id} must be a non-empty string of at most 200 characters")
        if role == KeyRole.approver and identity is None:
            raise ConfigurationError(f"{path}: approver key {key_id} names no identity (who approves with it)")
        keys[key_id] = PublicKey(key_id, role, public, _not_after(entry.get("not_after"), path, key_id), revoked,
                                 development, identity)
    return Keyring(keys)


_cache: dict[tuple[str, str, str], tuple[tuple[int, int], Any]] = {}


def _cached(path: Path, kind: str, environment: str, load) -> Any:
    """Reload a key file when it changed on disk (rotation and revocation need no restart)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigurationError(f"{kind} {path} does not exist (run `proofline keys generate --dir DIR` and set "
                                 "PROOFLINE_KEYS_DIR)") from None
    stamp = (st.st_mtime_ns, st.st_size)
    cache_key = (str(path), kind, environment)
    hit = _cache.get(cache_key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    value = load()
    _cache[cache_key] = (stamp, value)
    return value


def load_keyring(path: Path | None, environment: str = "development") -> Keyring:
    if path is None:
        raise ConfigurationError("no keyring configured: set PROOFLINE_KEYS_DIR or PROOFLINE_KEYRING_FILE")
    return _cached(path, "keyring", environment,
                   lambda: parse_keyring(_read_json(path, "keyring"), path, environment))


def load_signing_key(path: Path | None, role: KeyRole, environment: str = "development") -> SigningKey:
    if path is None:
        raise ConfigurationError(f"no {role.value} key configured: set PROOFLINE_KEYS_DIR or the key file setting")
    return _cached(path, role.value, environment, lambda: read_signing_key(path, role, environment))


def private_key_readable(path: Path | None) -> bool:
    """Whether this process could read a private key file (an execute worker must not)."""
    return path is not None and Path(path).is_file() and os.access(path, os.R_OK)


def _active_key(ring: Keyring, key: SigningKey) -> None:
    entry = ring.get(key.key_id)
    if entry is None or entry.role != key.role or entry.revoked:
        raise ConfigurationError(f"{key.role.value} key {key.key_id} is not an active {key.role.value} key in the "
                                 "keyring")


def check_process_keys(settings: Any, role: str) -> list[str]:
    """What a process of ``role`` (execute, recovery, all, controller) must and must not hold.

    Raises ConfigurationError (the process must not start); returns warnings for development.
    """
    env = settings.environment
    warnings: list[str] = []
    if role == "controller":
        load_signing_key(settings.signing_key_file, KeyRole.controller, env)
        return warnings
    ring = load_keyring(settings.keyring_file, env)
    if role in ("recovery", "all"):
        _active_key(ring, load_signing_key(settings.recovery_key_file, KeyRole.recovery, env))
    if role in ("execute", "all"):
        # Execution signs the evidence it records (proofline/signing.py, sign_evidence).
        _active_key(ring, load_signing_key(settings.worker_key_file, KeyRole.worker, env))
    if role == "execute":
        ledger = settings.ledger_key_file or (Path(settings.keys_dir) / FILES["ledger"] if settings.keys_dir else None)
        from proofline.auditor_keys import readable_by_this_process

        auditor = readable_by_this_process(settings)  # captures are sealed to it: a worker must not open them
        held = [str(p) for p in (settings.signing_key_file, settings.recovery_key_file, ledger, auditor)
                if private_key_readable(p)]
        if held and env == PRODUCTION:
            raise ConfigurationError(f"an execute worker must not be able to read signing keys: {', '.join(held)}")
        warnings += [f"execute worker can read the private key {p} (refused in production)" for p in held]
    if role == "all":
        if env == PRODUCTION:
            raise ConfigurationError("in production, recovery and execution run as separate processes "
                                     "(proofline worker --role recovery / --role execute)")
        warnings.append("one process runs both execution and recovery and holds the recovery key (development)")
    return warnings


# --- writing ---------------------------------------------------------------------------------------


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _write(path: Path, data: dict[str, Any], mode: int) -> None:
    """Write atomically with the final mode from the start (a private key is never briefly 0644)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(data, indent=2) + "\n")
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def new_key_id(role: str) -> str:
    return f"{role}-{datetime.now(UTC):%Y%m%d}-{secrets.token_hex(4)}"


def new_signing_key(role: KeyRole, development: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(private key file content, keyring entry) for a fresh Ed25519 key."""
    private = Ed25519PrivateKey.generate()
    key_id = new_key_id(role.value)
    seed = private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    key_file: dict[str, Any] = {"key_id": key_id, "role": role.value, "private_key": _b64(seed)}
    entry: dict[str, Any] = {"key_id": key_id, "role": role.value, "public_key": _b64(public), "not_after": None,
                             "revoked": False}
    if development:
        key_file["development"] = entry["development"] = True
    return key_file, entry


def generate(directory: Path, *, force: bool = False, development: bool = False) -> list[Path]:
    """Write controller.key, recovery.key, ledger.key, worker.key, seal.key, keyring.json and the
    auditor's X25519 pair (auditor.key, auditor.pub) into ``directory``."""
    from proofline.auditor_keys import PRIVATE_FILE as AUDITOR_KEY
    from proofline.auditor_keys import PUBLIC_FILE as AUDITOR_PUB
    from proofline.auditor_keys import write_pair

    directory = Path(directory)
    names = [*FILES.values(), SEAL_FILE, KEYRING_FILE, AUDITOR_KEY, AUDITOR_PUB]
    existing = [n for n in names if (directory / n).exists()]
    if existing and not force:
        raise ConfigurationError(f"{directory} already holds {', '.join(existing)}; pass --force to replace them")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    entries = []
    written = []
    for role_name, file_name in FILES.items():
        key_file, entry = new_signing_key(KeyRole(role_name), development)
        _write(directory / file_name, key_file, 0o600)
        entries.append(entry)
        written.append(directory / file_name)
    seal: dict[str, Any] = {"key_id": new_key_id("seal"), "key": _b64(secrets.token_bytes(32))}
    if development:
        seal["development"] = True
    _write(directory / SEAL_FILE, seal, 0o600)
    _write(directory / KEYRING_FILE, {"keys": entries}, 0o644)
    write_pair(directory / AUDITOR_KEY, directory / AUDITOR_PUB, development=development, force=True)
    return [*written, directory / SEAL_FILE, directory / KEYRING_FILE, directory / AUDITOR_KEY,
            directory / AUDITOR_PUB]


def rotate(directory: Path, role: KeyRole, overlap: timedelta) -> tuple[str, str]:
    """Make a new key of ``role`` the one that signs, keeping the old one verifiable until
    now + ``overlap`` (its keyring entry gets that ``not_after``). Returns (old id, new id)."""
    directory = Path(directory)
    key_path, ring_path = directory / FILES[role.value], directory / KEYRING_FILE
    old = _read_json(key_path, f"{role.value} key file")
    ring = _read_json(ring_path, "keyring")
    parse_keyring(ring, ring_path)
    until = (datetime.now(UTC) + overlap).isoformat()
    for entry in ring["keys"]:
        if entry["key_id"] == old.get("key_id"):
            entry["not_after"] = until
    key_file, entry = new_signing_key(role, development=old.get("development", False) is True)
    ring["keys"].append(entry)
    # Keyring first: a message signed with the new key must never meet a keyring without it.
    _write(ring_path, ring, 0o644)
    _write(key_path, key_file, 0o600)
    return str(old.get("key_id")), key_file["key_id"]


def add_approver(keyring_path: Path, key_path: Path, identity: str, development: bool = False) -> str:
    """Make an approver key for ``identity``: its private file at ``key_path`` (0600, for that person
    or approval service alone) and its public entry, naming the identity, in the keyring."""
    return _add_key(keyring_path, key_path, KeyRole.approver, development, identity=identity)


def add_worker(keyring_path: Path, key_path: Path, development: bool = False) -> str:
    """One more worker key (another worker host or process): its private file at ``key_path`` (0600,
    for that worker alone) and its public entry in the keyring."""
    return _add_key(keyring_path, key_path, KeyRole.worker, development)


def _add_key(keyring_path: Path, key_path: Path, role: KeyRole, development: bool, **extra: str) -> str:
    ring = _read_json(keyring_path, "keyring")
    parse_keyring(ring, keyring_path)
    if Path(key_path).exists():
        raise ConfigurationError(f"{key_path} already exists; {role.value} keys are never overwritten")
    key_file, entry = new_signing_key(role, development)
    key_file.update(extra)
    entry.update(extra)
    ring["keys"].append(entry)
    # Private file first: a keyring entry without its key would be harmless, the reverse never happens.
    Path(key_path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    _write(Path(key_path), key_file, 0o600)
    _write(Path(keyring_path), ring, 0o644)
    return str(key_file["key_id"])


def revoke(keyring_path: Path, key_id: str) -> None:
    """Mark a key revoked: every message it signed is refused from now on (fresh or stored)."""
    ring = _read_json(keyring_path, "keyring")
    parse_keyring(ring, keyring_path)
    matches = [e for e in ring["keys"] if e["key_id"] == key_id]
    if not matches:
        raise ConfigurationError(f"{keyring_path}: no key {key_id}")
    matches[0]["revoked"] = True
    _write(Path(keyring_path), ring, 0o644)

