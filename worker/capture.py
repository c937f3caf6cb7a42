"""Capturing what a contract's ``evidence_capture`` policy asks for: the raw arguments, result
values and reads, sealed to the auditor's public key, into the protected evidence store.

Three rules keep the action's own evidence safe:

- **Fail closed before the call.** A contract that captures needs a usable auditor public key;
  without one the action is refused at revalidation (``evidence_capture_unavailable``), before
  anything is sent: a capture the contract demands is never silently skipped.
- **Seal before writing, write after the result.** Sealing is local computation. The rows and their
  ``evidence_captured`` event are written in a transaction of their own *after* the call's result
  has committed, so a failed capture write can never roll the result back; it is logged (and the
  ledger shows no ``evidence_captured`` for the action, which an auditor sees).
- **Values never leave this module in the clear.** Only ciphertext goes to Postgres; the ledger
  event carries digests; logs name capture ids and counts.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import psycopg

from ledger import store, vault_store
from ledger.states import CaptureKind
from proofline.auditor_keys import AuditorPublicKey, load_public
from proofline.contracts import Contract
from proofline.errors import ProoflineError
from proofline.vault import Sealed, seal
from worker.runtime import Runtime

log = logging.getLogger(__name__)


def require(rt: Runtime, contract: Contract, evidence: dict[str, Any]) -> AuditorPublicKey | None:
    """At revalidation, before anything is sent: the auditor key this action's captures will be
    sealed to (``None`` when its contract captures nothing), noted in ``evidence`` (the
    ``revalidated`` event). Raises ``evidence_capture_unavailable`` without a usable key."""
    policy = contract.evidence_capture
    if not policy.enabled:
        return None
    key = load_public(rt.settings)
    evidence["evidence_capture"] = {
        "key_id": key.key_id, "retention": policy.retention,
        "kinds": [k for k, on in (("arguments", policy.arguments), ("result", policy.result),
                                  ("reads", policy.reads)) if on]}
    return key


def _seal(rt: Runtime, key: AuditorPublicKey, action_id: str,
          items: list[tuple[CaptureKind, Any]]) -> list[Sealed]:
    try:
        return [seal(key, capture_id=f"cap-{uuid.uuid4().hex}", action_id=action_id, kind=kind.value, value=value)
                for kind, value in items]
    except Exception as exc:  # noqa: BLE001 - a value that cannot be sealed must not cost the result
        _failed(rt, action_id, len(items), exc)
        return []


def seal_call(rt: Runtime, key: AuditorPublicKey | None, envelope: Any, contract: Contract, before: Any,
              values: Any, first_after: Any = None) -> list[Sealed]:
    """The execute task's captures, sealed with the key :func:`require` loaded: arguments as sent,
    the result's values, the precondition read and the read made in place (each only when the
    policy asks and there is something to keep). Never raises: the call has been made."""
    policy = contract.evidence_capture
    if key is None or not policy.enabled:
        return []
    items: list[tuple[CaptureKind, Any]] = []
    if policy.arguments:
        items.append((CaptureKind.arguments, envelope.arguments))
    if policy.result and values is not None:
        items.append((CaptureKind.result, values))
    if policy.reads:
        items.append((CaptureKind.precondition_read, before))
        if first_after is not None:
            items.append((CaptureKind.verification_read, {"source": "primary", "after": first_after}))
    return _seal(rt, key, envelope.action_id, items)


def capture_reads(rt: Runtime, action_id: str, contract: Contract, readings: list[dict[str, Any]]) -> None:
    """The verification task's captures, after its verdict committed: each read's raw ``after``
    (the authoritative read first). Never raises."""
    policy = contract.evidence_capture
    if not (policy.enabled and policy.reads and readings):
        return
    items = [(CaptureKind.verification_read, {"source": r.get("source"), "after": r.get("after")}) for r in readings]
    try:
        key = load_public(rt.settings)
    except ProoflineError as exc:
        _failed(rt, action_id, len(items), exc)
        return
    write(rt, action_id, contract, _seal(rt, key, action_id, items))


def _failed(rt: Runtime, action_id: str, count: int, exc: BaseException) -> None:
    """A capture that could not be sealed or stored: logged, and recorded on the action's chain when
    the ledger can still be written (its own transaction; the action's evidence is already in)."""
    log.error("evidence capture not stored", extra={
        "action_id": action_id, "event": "evidence_capture_failed", "captures": count, "error": type(exc).__name__})
    try:
        with store.transaction(rt.conn) as cur:
            store.append_event_txn(cur, action_id, "evidence_capture_failed", rt.settings.worker_id,
                                   {"captures": count, "error": type(exc).__name__,
                                    "reason_code": getattr(exc, "code", None)})
    except (psycopg.Error, ProoflineError):
        log.error("evidence capture failure not recorded", extra={"action_id": action_id,
                                                                  "event": "evidence_capture_failed"})


def write(rt: Runtime, action_id: str, contract: Contract, items: list[Sealed]) -> bool:
    """Store sealed captures after the action's own evidence committed. A failure is logged, never
    raised: the result is already recorded and must stay the task's answer."""
    if not items:
        return True
    try:
        vault_store.write(rt.conn, action_id, items, contract.evidence_capture.retention, rt.settings.worker_id)
    except (psycopg.Error, ProoflineError) as exc:
        if isinstance(exc, psycopg.OperationalError):
            rt.reset_connection()
        _failed(rt, action_id, len(items), exc)
        return False
    return True
