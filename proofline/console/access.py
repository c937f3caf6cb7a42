"""Who may use the console, and how a write proves it came from the console's own page.

Operators are named in a users file (JSON, ``PROOFLINE_CONSOLE_USERS_FILE``): a name, a role
(``viewer`` reads; ``operator`` also acts; ``approver`` approves proposals; ``auditor`` alone
opens the protected evidence store's captures, each read recorded in the ledger) and the sha256 of a
random token the operator logs in with. An approver also names the approver key file the console
signs that user's approvals with (:mod:`proofline.console.approvers` checks it at start). The file never holds a token itself; ``proofline console add-user`` writes it and prints the
token once. A login opens a server-side session: the cookie is a random id (HttpOnly,
SameSite=Strict), the session holds the user, the role and a CSRF token. Every write must send that
token back (a form field, or the ``X-CSRF-Token`` header htmx adds): a write without it, or from a
viewer, is refused with a stable reason code before anything is read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from proofline.errors import ConfigurationError, ConsoleForbidden, CsrfRefused

SESSION_COOKIE = "proofline_console"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
#: A session not used for this long is forgotten (the operator logs in again).
SESSION_IDLE_SECONDS = 8 * 3600
#: At most this many sessions are held; the least recently used goes first.
MAX_SESSIONS = 1000


class ConsoleRole(str, Enum):
    #: reads every page, changes nothing
    viewer = "viewer"
    #: also resolves, retries and cancels escalated actions, sets and clears kill switches and revocations
    operator = "operator"
    #: approves proposals with their own approver key; also denies proposals and revokes approvals
    approver = "approver"
    #: reads every page, and alone opens captured evidence (docs/security/evidence-store.md); each read
    #: is a ledger event naming the user
    auditor = "auditor"


#: Who may send each kind of write. Only an approver approves (an operator holds no approver key);
#: denying a proposal or revoking an approval stops something from running, which both may do.
OPERATOR_ONLY = frozenset({ConsoleRole.operator})
APPROVER_ONLY = frozenset({ConsoleRole.approver})
PROPOSAL_STOPPERS = frozenset({ConsoleRole.operator, ConsoleRole.approver})
#: Only an auditor opens the evidence store (the page itself too: the others do not see what was captured).
AUDITOR_ONLY = frozenset({ConsoleRole.auditor})


@dataclass(frozen=True)
class User:
    name: str
    role: ConsoleRole
    token_sha256: str
    #: The approver key file this user's approvals are signed with (approvers only).
    approver_key: Path | None = None


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def load_users(path: Path) -> dict[str, User]:
    """The users file, or :class:`ConfigurationError` naming what is wrong with it."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigurationError(f"no console users file at {path}: create one with "
                                 "`proofline console add-user NAME --role operator`") from None
    except ValueError as exc:
        raise ConfigurationError(f"the console users file {path} is not JSON: {exc}") from None
    users = data.get("users") if isinstance(data, dict) else None
    if not isinstance(users, dict) or not users:
        raise ConfigurationError(f"the console users file {path} names no user (expected {{\"users\": {{...}}}})")
    found = {}
    for name, entry in users.items():
        role = entry.get("role") if isinstance(entry, dict) else None
        digest = entry.get("token_sha256") if isinstance(entry, dict) else None
        if role not in {r.value for r in ConsoleRole} or not isinstance(digest, str) or len(digest) != 64:
            raise ConfigurationError(f"console user {name!r} in {path} needs a role (viewer, operator, approver or auditor) "
                                     "and a token_sha256")
        key = entry.get("approver_key")
        if (role == ConsoleRole.approver.value) != isinstance(key, str) or key == "":
            raise ConfigurationError(f"console user {name!r} in {path}: an approver, and only an approver, names "
                                     "its approver_key file")
        found[name] = User(name, ConsoleRole(role), digest, Path(key) if key else None)
    return found


def add_user(path: Path, name: str, role: ConsoleRole, approver_key: Path | None = None) -> str:
    """Add (or replace) a user with a fresh token; returns the token, which is stored only hashed.
    An approver needs ``approver_key``, the key file the console signs that user's approvals with."""
    if not name or not name.replace("-", "").replace("_", "").replace(".", "").replace("@", "").isalnum():
        raise ConfigurationError(f"a console user name is letters, digits and - _ . @ (got {name!r})")
    if (role == ConsoleRole.approver) != (approver_key is not None):
        raise ConfigurationError("an approver user needs --approver-key (and only an approver has one)")
    data: dict[str, Any] = {"users": {}}
    if path.exists():
        data = json.loads(path.read_text())
    token = secrets.token_urlsafe(24)
    entry = {"role": role.value, "token_sha256": token_digest(token)}
    if approver_key is not None:
        entry["approver_key"] = str(Path(approver_key).resolve())
    data.setdefault("users", {})[name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    path.chmod(0o600)
    return token


@dataclass(frozen=True)
class Session:
    user: str
    role: ConsoleRole
    csrf: str


class Sessions:
    """Server-side sessions by random id; a restart of the console logs everyone out."""

    def __init__(self, users: dict[str, User]) -> None:
        self.users = users
        self._held: dict[str, tuple[Session, float]] = {}
        self._lock = threading.Lock()

    def login(self, name: str, token: str) -> tuple[str, Session] | None:
        user = self.users.get(name)
        # Compare digests in constant time; an unknown name costs the same as a wrong token.
        expected = user.token_sha256 if user else "0" * 64
        if not hmac.compare_digest(expected, token_digest(token)) or user is None:
            return None
        session_id = secrets.token_urlsafe(32)
        session = Session(user.name, user.role, secrets.token_urlsafe(32))
        with self._lock:
            if len(self._held) >= MAX_SESSIONS:
                oldest = min(self._held, key=lambda k: self._held[k][1])
                del self._held[oldest]
            self._held[session_id] = (session, time.monotonic())
        return session_id, session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        with self._lock:
            held = self._held.get(session_id)
            if held is None:
                return None
            session, last = held
            if time.monotonic() - last > SESSION_IDLE_SECONDS:
                del self._held[session_id]
                return None
            self._held[session_id] = (session, time.monotonic())
            return session

    def logout(self, session_id: str | None) -> None:
        with self._lock:
            self._held.pop(session_id or "", None)


def _a(role: ConsoleRole) -> str:
    return f"{'an' if role.value[0] in 'aeiou' else 'a'} {role.value}"


def authorize_write(session: Session | None, sent_token: str | None,
                    roles: frozenset[ConsoleRole] = OPERATOR_ONLY) -> Session:
    """The session a write acts for, or a refusal: not logged in / a role not in ``roles``
    (``console_forbidden``), a missing or wrong CSRF token (``csrf_refused``)."""
    if session is None:
        raise ConsoleForbidden("log in first: writes need an operator session")
    if not sent_token or not hmac.compare_digest(session.csrf, sent_token):
        raise CsrfRefused("this write did not carry the session's CSRF token; reload the page and try again")
    if session.role not in roles:
        may = " or ".join(sorted(_a(r) for r in roles))
        raise ConsoleForbidden(f"{session.user} is {_a(session.role)}: only {may} may do this",
                               user=session.user, role=session.role.value)
    return session
