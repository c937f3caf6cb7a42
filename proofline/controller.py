"""The controller side: describe the live tool contract, build and sign envelopes, publish them.

Publishing records ``published`` in the ledger first and then sends the message, so that a lost
broker message is still visible as an action that was published and never started.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from mcp import Client

from ledger import seal, store
from ledger.redact import for_envelope, leaf_names
from ledger.states import ActionStatus
from proofline.canonical import tool_contract_hash
from proofline.contracts import contract_for
from proofline.envelope import Envelope, EvidenceRequirements, build_envelope
from proofline.errors import EnvelopeRefused, IdempotencyConflict
from proofline.keys import KeyRole, load_signing_key
from proofline.settings import Settings, get_settings
from proofline.signing import sign
from proofline.telemetry import tracing
from worker.dispatch import CeleryDispatch
from worker.mcp_client import endpoint_target
from worker.servers import server_named


def describe_server(settings: Settings, server_name: str) -> tuple[str | None, dict[str, str]]:
    """The live server version and the contract hash of each tool (what an approver reviews)."""
    server = server_named(Path(settings.servers_file), server_name)

    async def probe() -> tuple[str | None, dict[str, str]]:
        target = endpoint_target(server.write, Path(settings.servers_file).resolve().parent, name=server.name,
                                 environment=settings.environment)
        async with Client(target, mode=server.write.protocol) as client:
            tools = await client.list_tools(cache_mode="bypass")
            version = client.server_info.version if client.server_info else None
            return version, {t.name: tool_contract_hash(t) for t in tools.tools}

    return asyncio.run(probe())


def prepare(
    settings: Settings,
    *,
    action_type: str,
    arguments: dict[str, Any],
    target: dict[str, Any],
    tenant: str,
    run_id: str,
    action_id: str,
    requester: str = "operator@example.com",
    workload_identity: str = "agent:ops-assistant",
    environment: str | None = None,
    approval_id: str | None = None,
    approval_version: int = 1,
    approval_ttl: timedelta = timedelta(hours=1),
    deadline_in: timedelta = timedelta(minutes=10),
    live: tuple[str | None, dict[str, str]] | None = None,
    **extra: Any,
) -> Envelope:
    """Build an envelope bound to the live tool contract named by the action contract.

    ``environment`` defaults to this deployment's (``settings.environment``): a worker refuses an
    envelope approved for another one. The contract's ``sensitive_fields`` are added to the
    envelope's ``evidence.redact_fields``, so the signed envelope itself declares them."""
    contract = contract_for(Path(settings.contracts_dir), action_type)
    version, hashes = live or describe_server(settings, contract.server)
    now = datetime.now(UTC)
    evidence = EvidenceRequirements.model_validate(extra.pop("evidence", None) or {})
    declared = tuple(dict.fromkeys((*evidence.redact_fields, *leaf_names(contract.sensitive_fields))))
    evidence = evidence.model_copy(update={"redact_fields": declared})
    return build_envelope(
        run_id=run_id, action_id=action_id, workflow_type=extra.pop("workflow_type", "agent.ops"),
        action_type=action_type, requester=requester, workload_identity=workload_identity, tenant=tenant,
        environment=environment or settings.environment, target=target, operation=contract.operation, arguments=arguments,
        server={"name": contract.server, "version": version or "unknown"},
        tool={"name": contract.tool, "contract_hash": hashes.get(contract.tool, "0" * 64)},
        policy_version=extra.pop("policy_version", settings.accepted_policy_versions[-1]),
        approval={"id": approval_id or f"apr-{action_id}", "version": approval_version,
                  "expires_at": now + approval_ttl, **extra.pop("approval_extra", {})},
        timeout_seconds=extra.pop("timeout_seconds", contract.timeout_seconds),
        deadline=now + deadline_in, evidence=evidence, **extra,
    )


def signed_message(settings: Settings, envelope: Envelope) -> dict[str, Any]:
    """Sign a fresh action with the controller's private key (read from its key file)."""
    return sign(envelope, load_signing_key(settings.signing_key_file, KeyRole.controller, settings.environment))


def send_message(app: Any, message: Any, queue: str = "actions", task_id: str | None = None) -> str:
    """Put one message on a queue by the stable task name (JSON only)."""
    return CeleryDispatch(app).execute(message, queue=queue, task_id=task_id)


def validate_for_publish(settings: Settings, message: dict[str, Any]) -> None:
    """Run the worker's own validation (size, signature, schema v1, argument hash, idempotency key,
    contract match) on a message about to be published. A message every worker would refuse is
    never recorded as ``published``: it would be refused on every delivery and re-sent forever."""
    from worker.validate import validate_envelope

    validate_envelope(message, settings, lambda action_type: contract_for(Path(settings.contracts_dir),
                                                                           action_type))


def publish(settings: Settings, conn: Any, app: Any, envelope: Envelope, **options: Any) -> dict[str, Any]:
    """Sign an envelope, record ``published`` (or ``pending`` with ``hold=True``) and send it."""
    return publish_message(conn, CeleryDispatch(app, settings.tenant_shards), signed_message(settings, envelope), envelope,
                           settings=settings, **options)


def publish_message(conn: Any, dispatch: Any, message: dict[str, Any], envelope: Envelope, **options: Any
                    ) -> dict[str, Any]:
    """See :func:`_publish_message`; a span of the action's trace when tracing is on."""
    attributes = {**tracing.about(envelope), "proofline.stage": "publish"}
    with tracing.span("proofline.authorize_and_publish", **attributes):
        return _publish_message(conn, dispatch, message, envelope, **options)


def _publish_message(conn: Any, dispatch: Any, message: dict[str, Any], envelope: Envelope, *,
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
    try:
        validate_for_publish(settings, message)
    except EnvelopeRefused as exc:
        _record_publish_refusal(conn, message, exc, actor or settings.worker_id)
        raise
    seal_key = seal_key or seal.sealer_for(settings)
    task_id = str(uuid.uuid4())
    conflict: IdempotencyConflict | None = None
    redactor = for_envelope(message["envelope"])
    with store.transaction(conn) as cur:
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
        else:
            name = ("pending" if hold else "published") if inserted else "republished"
            store.append_event_txn(cur, envelope.action_id, name, actor or envelope.requester,
                                   {**_publication_evidence(envelope, message["key_id"]), "kind": kind,
                                    "parent_action_id": parent_action_id, "task_id": task_id},
                                   redactor)
    if conflict is not None:
        raise conflict
    if not hold:
        dispatch.execute(message, queue=queue, task_id=task_id)
    return {"action_id": envelope.action_id, "task_id": task_id, "republished": not inserted, "held": hold}


def _record_publish_refusal(conn: Any, message: Any, exc: EnvelopeRefused, actor: str) -> None:
    from worker.refusals import record
    from worker.validate import claimed_fields, refusal_chain_id

    record(conn, refusal_chain_id(message), "publish_refused", actor,
           {**exc.as_evidence(), "claimed": claimed_fields(message), "by": "controller"})


def publish_run(settings: Settings, conn: Any, app: Any, envelopes: list[Envelope]) -> list[dict[str, Any]]:
    """Publish a multi-step run: every step is recorded now, only the first is sent. Each later step
    is released by the runtime once the step before it is verified (``recovery/runs.py``)."""
    run_ids = {e.run_id for e in envelopes}
    steps = [e.step for e in envelopes]
    if len(run_ids) != 1 or steps != list(range(len(envelopes))) or any(e.run_steps != len(envelopes)
                                                                           for e in envelopes):
        raise ValueError("a run is one run id with steps 0..n-1 in order, each envelope saying run_steps=n")
    # One trace for the run: its later steps are released from the trace of the step before them.
    with tracing.span("proofline.publish_run", **{"proofline.workflow": envelopes[0].workflow_type}):
        return [publish(settings, conn, app, e, hold=e.step > 0) for e in envelopes]


def _publication_evidence(envelope: Envelope, key_id: str) -> dict[str, Any]:
    """Who authorized what: the part of the envelope an auditor reads first."""
    doc = envelope.model_dump(mode="json")
    keep = ("run_id", "requester", "workload_identity", "tenant", "environment", "approval", "policy_version",
            "tool", "server", "target", "operation", "arguments", "arguments_hash", "idempotency_key",
            "irreversible", "deadline")
    return {**{k: doc[k] for k in keep}, "key_id": key_id}
