"""Publishing a signed message: validate it as every worker will, record it in the ledger (sealed),
then hand it to a dispatcher. The controller publishes actions this way, recovery its derived ones.

Recording comes first, so a message the broker loses is still visible as an action that was
published and never started (and the reconciler re-drives exactly what was signed). The
dispatcher is whatever the caller passes (``worker/dispatch.py`` in production): the ledger
knows no broker.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from ledger import seal, store
from ledger.redact import for_envelope
from ledger.refusals import record
from ledger.states import ActionStatus
from proofline.contracts import contract_for
from proofline.envelope import Envelope
from proofline.errors import EnvelopeRefused, IdempotencyConflict
from proofline.settings import Settings, get_settings
from proofline.validation import claimed_fields, refusal_chain_id, validate_envelope


def validate_for_publish(settings: Settings, message: dict[str, Any]) -> None:
    """Run the worker's own validation (size, signature, schema v1, argument hash, idempotency key,
    contract match) on a message about to be published. A message every worker would refuse is
    never recorded as ``published``: it would be refused on every delivery and re-sent forever."""
    validate_envelope(message, settings, lambda action_type: contract_for(Path(settings.contracts_dir),
                                                                           action_type))


def publish_message(conn: Any, dispatch: Any, message: dict[str, Any], envelope: Envelope, *,
                    seal_key: seal.SealKey | None = None, queue: str = "actions", kind: str = "action",
                    parent_action_id: str | None = None, hold: bool = False, actor: str | None = None,
                    settings: Settings | None = None) -> dict[str, Any]:
    """Validate a signed message as the worker will, record it in the ledger, then send it (unless held).

    The signed message is stored with the action, sealed with ``seal_key`` (default: the settings'
    seal key; ``actions.envelope`` is a redacted copy) as its exact canonical bytes, so the
    reconciler can re-drive exactly the authority the controller signed if the broker loses the
    message. A message the worker would refuse raises that refusal here and is recorded on its
    refusal chain (``publish_refused``), never as a published action.
    """
    settings = settings or get_settings()
    checked_for_publish(settings, conn, message, actor)
    seal_key = seal_key or seal.sealer_for(settings)
    with store.transaction(conn) as cur:
        recorded = record_publication_txn(cur, message, envelope, seal_key=seal_key, kind=kind,
                                          parent_action_id=parent_action_id, hold=hold, actor=actor)
    if isinstance(recorded, IdempotencyConflict):
        raise recorded
    if not hold:
        dispatch.execute(message, queue=queue, task_id=recorded["task_id"])
    return recorded


def checked_for_publish(settings: Settings, conn: Any, message: dict[str, Any], actor: str | None) -> None:
    """Validate a message as the worker will; a refusal is recorded on its refusal chain and raised."""
    try:
        validate_for_publish(settings, message)
    except EnvelopeRefused as exc:
        _record_publish_refusal(conn, message, exc, actor or settings.worker_id)
        raise


def _record_publish_refusal(conn: Any, message: Any, exc: EnvelopeRefused, actor: str) -> None:
    record(conn, refusal_chain_id(message), "publish_refused", actor,
           {**exc.as_evidence(), "claimed": claimed_fields(message), "by": "controller"})


def _publication_evidence(envelope: Envelope, key_id: str) -> dict[str, Any]:
    """Who authorized what: the part of the envelope an auditor reads first."""
    doc = envelope.model_dump(mode="json")
    keep = ("run_id", "requester", "workload_identity", "tenant", "environment", "approval", "policy_version",
            "tool", "server", "target", "operation", "arguments", "arguments_hash", "idempotency_key",
            "irreversible", "deadline")
    return {**{k: doc[k] for k in keep}, "key_id": key_id}


def record_publication_txn(cur: Any, message: dict[str, Any], envelope: Envelope, *, seal_key: seal.SealKey,
                           kind: str = "action", parent_action_id: str | None = None, hold: bool = False,
                           actor: str | None = None) -> dict[str, Any] | IdempotencyConflict:
    """Record one validated message inside the caller's transaction: the action row and its
    ``published`` (``pending``, ``republished``) event, or, for the same action id with other
    arguments, a ``publish_refused`` event, returned (not raised) so that a batch can still commit
    the rest."""
    task_id = str(uuid.uuid4())
    redactor = for_envelope(message["envelope"])
    inserted = store.insert_action_txn(
        cur, message["envelope"], message=message, seal_key=seal_key, redactor=redactor, task_id=task_id,
        status=ActionStatus.pending if hold else ActionStatus.published, kind=kind,
        parent_action_id=parent_action_id)
    current = None if inserted else store.get_action(cur, envelope.action_id)
    if current is not None and current.idempotency_key != envelope.idempotency_key:
        conflict = IdempotencyConflict(f"action {envelope.action_id} already published with other arguments",
                                       idempotency_key=envelope.idempotency_key)
        store.append_event_txn(cur, envelope.action_id, "publish_refused", actor or envelope.requester,
                               conflict.as_evidence())
        return conflict
    name = ("pending" if hold else "published") if inserted else "republished"
    store.append_event_txn(cur, envelope.action_id, name, actor or envelope.requester,
                           {**_publication_evidence(envelope, message["key_id"]), "kind": kind,
                            "parent_action_id": parent_action_id, "task_id": task_id},
                           redactor)
    return {"action_id": envelope.action_id, "task_id": task_id, "republished": not inserted, "held": hold}
