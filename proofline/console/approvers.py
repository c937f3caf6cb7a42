"""The console as an approval service for its approver users: each one's own approver key.

An approver user in the users file names an approver key file. At start the console loads every
such key and refuses to start (``configuration_error``) unless it is an active ``approver`` key in
the keyring, so a typo or a revoked key shows up before anyone tries to approve. An approval is
then signed with the key of the user who is logged in, and with no other: the key is looked up by
the session's user name, never chosen by the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proofline.console.access import ConsoleRole, User
from proofline.errors import ConfigurationError, ProoflineError
from proofline.keys import KeyRole, SigningKey, load_keyring, load_signing_key


@dataclass(frozen=True)
class Approver:
    key: SigningKey
    #: The keyring's identity for the key: what every approval this user signs records.
    identity: str


def approver_keys(users: dict[str, User], settings: Any) -> dict[str, Approver]:
    """Every approver user's signing key, checked against the keyring, by user name."""
    approvers = {name: user for name, user in users.items() if user.role == ConsoleRole.approver}
    if not approvers:
        return {}
    keyring = load_keyring(settings.keyring_file, settings.environment)
    keys = {}
    for name, user in approvers.items():
        try:
            key = load_signing_key(user.approver_key, KeyRole.approver, settings.environment)
        except ProoflineError as exc:
            raise ConfigurationError(f"console approver {name!r}: its key file {user.approver_key} cannot be used: "
                                     f"{exc.detail}", user=name) from None
        entry = keyring.get(key.key_id)
        if entry is None or entry.role != KeyRole.approver or entry.revoked:
            why = "not in the keyring" if entry is None else "revoked" if entry.revoked else f"a {entry.role.value} key"
            raise ConfigurationError(f"console approver {name!r}: key {key.key_id} is {why}; an approver user needs "
                                     "an active approver key (proofline keys add-approver)", user=name,
                                     key_id=key.key_id)
        keys[name] = Approver(key, entry.identity or key.key_id)
    return keys
