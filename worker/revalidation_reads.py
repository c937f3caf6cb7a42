"""Reads the revalidation makes besides the live tool contract: when a retired key's message was
stored, the parent a recovery envelope derives from, and the live hashes of the recovery tools."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ledger import store
from proofline.contracts import Contract
from proofline.envelope import Envelope
from proofline.errors import ProoflineError
from proofline.keys import load_keyring
from worker.runtime import Runtime
from worker.validate import check_parent_link


class StoredAt:
    """When the ledger stored this delivery's exact signed message; asked only when its signing key
    has retired (a rotation's overlap ended), so the common path makes no extra read."""

    def __init__(self, rt: Runtime, message: Any) -> None:
        self.rt, self.message = rt, message
        self.evidence: dict[str, Any] | None = None

    def __call__(self) -> datetime | None:
        with self.rt.conn.cursor() as cur:
            at = store.stored_message_at(cur, self.message)
        if at is not None:
            self.evidence = {"key_id": self.message.get("key_id"), "stored_at": at.isoformat()}
        return at


def check_recovery_parent(rt: Runtime, envelope: Envelope) -> dict[str, Any]:
    """A recovery-signed envelope must derive from a stored, controller-signed parent (one read)."""
    with rt.conn.cursor() as cur:
        parent = store.get_action(cur, envelope.recovers)
    keyring = load_keyring(rt.settings.keyring_file, rt.settings.environment)
    return check_parent_link(envelope, parent, keyring, rt.contract)


def recovery_tool_hashes(rt: Runtime, contract: Contract, server_name: str,
                         hashes: dict[str, str]) -> dict[str, str]:
    """The live contract hashes of the tools this action's recovery actions would call on the same
    server, as read now; recorded with the revalidation so recovery never has to list tools itself."""
    tools: dict[str, str] = {}
    for spec in (contract.recovery.compensation, contract.recovery.rollback, contract.recovery.forward):
        if spec is None:
            continue
        try:
            derived = rt.contract(spec.action_type)
        except ProoflineError:
            continue  # a broken recovery contract is refused when recovery needs it, with its reason
        if derived.server == server_name and derived.tool in hashes:
            tools[derived.tool] = hashes[derived.tool]
    return tools
