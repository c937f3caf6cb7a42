"""The controller side: describe the live tool contract, build and sign envelopes, publish them.

Publishing records ``published`` in the ledger first and then sends the message, so that a lost
broker message is still visible as an action that was published and never started.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

import anyio
from kombu.exceptions import OperationalError
from mcp import Client
from pydantic import ValidationError

from ledger import seal, store
from ledger.publication import (  # noqa: F401 - the controller's API
    checked_for_publish,
    record_publication_txn,
    validate_for_publish,
)
from ledger.publication import (
    publish_message as _publish_message,
)
from ledger.redact import leaf_names
from proofline.arguments import check_arguments
from proofline.canonical import tool_contract_hash
from proofline.contracts import Contract, contract_for
from proofline.envelope import Envelope, EvidenceRequirements, build_envelope, reported_version
from proofline.errors import (
    BrokerUnavailable,
    IdempotencyConflict,
    MalformedEnvelope,
    McpUnavailable,
    UnknownTool,
)
from proofline.keys import KeyRole, load_signing_key
from proofline.pins import (
    Negotiated,
    missing_tools,
    pinned_schema,
    pinned_tool,
    pins_path,
    read_pins,
    unknown_tool_detail,
)
from proofline.settings import Settings
from proofline.signing import sign
from proofline.telemetry import tracing
from worker.dispatch import CeleryDispatch
from worker.mcp_client import connectable, endpoint_target, negotiated
from worker.servers import server_named


def describe_server(settings: Settings, server_name: str) -> tuple[str | None, dict[str, str]]:
    """The live server version and the contract hash of each tool (what an approver reviews)."""
    version, hashes, _ = describe_tools(settings, server_name)
    return version, hashes


def describe_tools(settings: Settings, server_name: str) -> tuple[str | None, dict[str, str], dict[str, dict[str, Any]]]:
    """:func:`describe_server` and the input schema of each tool."""
    version, hashes, schemas, _ = describe_negotiated(settings, server_name)
    return version, hashes, schemas


def describe_negotiated(settings: Settings, server_name: str) -> tuple[str | None, dict[str, str],
                                                                       dict[str, dict[str, Any]], Negotiated]:
    """:func:`describe_tools` and what the session negotiated (what ``contracts pin`` records).

    The session's opening and the tool list get twice ``mcp_connect_timeout_seconds`` together: a
    server that starts and never answers is refused as ``mcp_unavailable`` (and stopped), never
    waited on."""
    server = server_named(Path(settings.servers_file), server_name)
    bound = 2 * settings.mcp_connect_timeout_seconds  # the opening and the list, each given the limit

    async def probe() -> tuple[str | None, dict[str, str], dict[str, dict[str, Any]], Negotiated]:
        identity = None
        if server.write.auth is not None:  # the write identity's own OAuth token (worker/oauth.py)
            from worker.oauth import Identity

            identity = Identity(server.name, "write", server.write, Path(settings.state_dir), lambda *_: None)
        try:
            if identity is not None:
                await identity.ensure()
            target = endpoint_target(server.write, settings.servers_base_dir, name=server.name,
                                     environment=settings.environment,
                                     auth=identity.provider if identity is not None else None)
            with anyio.fail_after(bound):
                async with Client(connectable(target, server.name, "write"), mode=server.write.protocol) as client:
                    tools = await client.list_tools(cache_mode="bypass")
                    version = reported_version(client.server_info.version if client.server_info else None)
                    return (version, {t.name: tool_contract_hash(t) for t in tools.tools},
                            {t.name: dict(t.input_schema) for t in tools.tools}, negotiated(client))
        except TimeoutError as exc:
            raise McpUnavailable(f"{server.name}/write: no tool list within {bound:g}s "
                                 "(twice PROOFLINE_MCP_CONNECT_TIMEOUT_SECONDS)") from exc
        finally:
            if identity is not None:
                await identity.close()

    return asyncio.run(probe())


def pinned_or_live(settings: Settings, contract: Contract,
                   live: tuple[str | None, dict[str, str]] | None) -> tuple[str | None, str]:
    """The server version and tool contract hash an envelope is bound to: from ``live`` (a
    description the caller read itself) when given, else from the pinned contract registry. No
    server is started here; a tool the server does not list is refused as ``unknown_tool``."""
    if live is None:
        path = pins_path(settings)
        return pinned_tool(read_pins(path), contract, path)
    version, hashes = live
    if missing_tools(contract, hashes):
        raise UnknownTool(unknown_tool_detail(contract, hashes), action_type=contract.action_type)
    return version, hashes[contract.tool]


def publisher(settings: Settings) -> tuple[str, str]:
    """The requester and workload identity an envelope names when its caller names none: the
    settings' ``requester`` and ``workload_identity``, else the user and host that publish."""
    import getpass
    import socket

    who = f"{getpass.getuser()}@{socket.gethostname()}"
    return settings.requester or who, settings.workload_identity or f"proofline-controller:{who}"


def fresh_ids(run_id: str | None, action_id: str | None) -> tuple[str, str]:
    """A run id and an action id, made fresh where the caller gave none (the action's own run)."""
    action_id = action_id or f"act-{uuid.uuid4().hex}"
    return run_id or f"run-{action_id}", action_id


def prepare(
    settings: Settings,
    *,
    action_type: str,
    arguments: dict[str, Any],
    target: dict[str, Any],
    tenant: str,
    run_id: str,
    action_id: str,
    requester: str | None = None,
    workload_identity: str | None = None,
    environment: str | None = None,
    approval_id: str | None = None,
    approval_version: int = 1,
    approval_ttl: timedelta = timedelta(hours=1),
    deadline_in: timedelta = timedelta(minutes=10),
    live: tuple[str | None, dict[str, str]] | None = None,
    **extra: Any,
) -> Envelope:
    """Build an envelope bound to the reviewed tool contract named by the action contract: the
    pinned one (``proofline contracts pin``), or ``live`` when the caller passes a description.

    ``environment`` defaults to this deployment's (``settings.environment``): a worker refuses an
    envelope approved for another one. The contract's ``sensitive_fields`` are added to the
    envelope's ``evidence.redact_fields``, so the signed envelope itself declares them.

    From the pins, the arguments are checked against the tool's pinned input schema first
    (``arguments_invalid``). Fields that do not make a valid envelope (an action id with a space)
    are ``envelope_malformed``, never a raw pydantic error."""
    contract = contract_for(Path(settings.contracts_dir), action_type)
    default_requester, default_workload = publisher(settings)
    requester, workload_identity = requester or default_requester, workload_identity or default_workload
    version, contract_hash = pinned_or_live(settings, contract, live)
    if live is None:
        path = pins_path(settings)
        check_arguments(contract.tool, pinned_schema(read_pins(path), contract, path), arguments)
    now = datetime.now(UTC)
    try:
        evidence = EvidenceRequirements.model_validate(extra.pop("evidence", None) or {})
        declared = tuple(dict.fromkeys((*evidence.redact_fields, *leaf_names(contract.sensitive_fields))))
        evidence = evidence.model_copy(update={"redact_fields": declared})
        return build_envelope(
            run_id=run_id, action_id=action_id, workflow_type=extra.pop("workflow_type", "agent.ops"),
            action_type=action_type, requester=requester, workload_identity=workload_identity, tenant=tenant,
            environment=environment or settings.environment, target=target, operation=contract.operation,
            arguments=arguments, server={"name": contract.server, "version": reported_version(version)},
            tool={"name": contract.tool, "contract_hash": contract_hash},
            policy_version=extra.pop("policy_version", settings.accepted_policy_versions[-1]),
            approval={"id": approval_id or f"apr-{action_id}", "version": approval_version,
                      "expires_at": now + approval_ttl, **extra.pop("approval_extra", {})},
            timeout_seconds=extra.pop("timeout_seconds", contract.timeout_seconds),
            deadline=now + deadline_in, evidence=evidence, **extra,
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise MalformedEnvelope(f"the envelope is not valid: {where}: {first['msg']}", field=where) from None


def signed_message(settings: Settings, envelope: Envelope) -> dict[str, Any]:
    """Sign a fresh action with the controller's private key (read from its key file)."""
    return sign(envelope, load_signing_key(settings.signing_key_file, KeyRole.controller, settings.environment))


def send_message(app: Any, message: Any, queue: str = "actions", task_id: str | None = None) -> str:
    """Put one message on a queue by the stable task name (JSON only)."""
    return CeleryDispatch(app).execute(message, queue=queue, task_id=task_id)


def publish(settings: Settings, conn: Any, app: Any, envelope: Envelope, **options: Any) -> dict[str, Any]:
    """Sign an envelope, record ``published`` (or ``pending`` with ``hold=True``) and send it."""
    return publish_message(conn, CeleryDispatch(app, settings.tenant_shards), signed_message(settings, envelope), envelope,
                           settings=settings, **options)


def broker_error(exc: BaseException) -> str:
    """What a broker error says; kombu's wrapper of a timeout says nothing, so its cause is named."""
    cause = exc.__cause__ or exc.__context__
    return str(exc) or (str(cause) if cause is not None and str(cause) else type(cause or exc).__name__)


@contextmanager
def handed_to_broker(action_id: str) -> Iterator[None]:
    """Around a send after the ledger recorded ``published``: a broker that did not take the message
    is ``broker_unavailable`` (retryable), never kombu's own error, and the record stays."""
    try:
        yield
    except OperationalError as exc:
        raise BrokerUnavailable(f"{action_id} is recorded as published but the broker did not take its message "
                                f"({broker_error(exc)}); the reconciler sends it once the broker is back",
                                action_id=action_id) from exc


def publish_message(conn: Any, dispatch: Any, message: dict[str, Any], envelope: Envelope, **options: Any
                    ) -> dict[str, Any]:
    """``ledger.publication.publish_message`` inside a span of the action's trace when tracing is on."""
    attributes = {**tracing.about(envelope), "proofline.stage": "publish"}
    with tracing.span("proofline.authorize_and_publish", **attributes), handed_to_broker(envelope.action_id):
        return _publish_message(conn, dispatch, message, envelope, **options)


class _Batch(NamedTuple):
    messages: list[dict[str, Any]]
    spans: list[Any]
    seal_key: Any


@contextmanager
def _signed_batch(settings: Settings, conn: Any, envelopes: list[Envelope], actor: str | None) -> Iterator[_Batch]:
    """Sign and validate every envelope first (one the worker would refuse is recorded on its
    refusal chain and raised before anything is recorded), with one publish span per action: one
    trace per action, its span current while its publication is recorded and sent; ended on exit."""
    messages = [signed_message(settings, e) for e in envelopes]
    for message in messages:
        checked_for_publish(settings, conn, message, actor)
    spans = [tracing.started("proofline.authorize_and_publish", **tracing.about(e), **{"proofline.stage": "publish"})
             for e in envelopes]
    try:
        yield _Batch(messages, spans, seal.sealer_for(settings))
    finally:
        for span in spans:
            tracing.end(span)


def _record_txn(cur: Any, batch: _Batch, envelopes: list[Envelope], actor: str | None,
                held: Callable[[Envelope], bool] = lambda e: False) -> list[dict[str, Any] | IdempotencyConflict]:
    recorded = []
    for message, envelope, span in zip(batch.messages, envelopes, batch.spans, strict=True):
        with tracing.current(span):
            recorded.append(record_publication_txn(cur, message, envelope, seal_key=batch.seal_key, actor=actor,
                                                   hold=held(envelope)))
    return recorded


def publish_many(settings: Settings, conn: Any, dispatch: Any, envelopes: list[Envelope],
                 actor: str | None = None) -> list[dict[str, Any] | IdempotencyConflict]:
    """Sign and publish N envelopes with one ledger transaction (one commit), then send their
    messages after it has committed.

    Every message is validated first: one the worker would refuse is recorded on its refusal chain
    and raised before anything of the batch is recorded. An action id already published with
    other arguments is recorded as ``publish_refused`` and returned as its conflict in its place;
    the rest of the batch is published."""
    if len({e.action_id for e in envelopes}) != len(envelopes):
        raise ValueError("a batch names each action id once")
    with _signed_batch(settings, conn, envelopes, actor) as batch:
        with store.transaction(conn) as cur:
            recorded = _record_txn(cur, batch, envelopes, actor)
        for message, outcome, span in zip(batch.messages, recorded, batch.spans, strict=True):
            if isinstance(outcome, dict):
                with tracing.current(span), handed_to_broker(outcome["action_id"]):
                    dispatch.execute(message, task_id=outcome["task_id"])
    return recorded


def publish_run(settings: Settings, conn: Any, app: Any, envelopes: list[Envelope]) -> list[dict[str, Any]]:
    """Publish a multi-step run: every step is recorded in one transaction (the first ``published``,
    the others ``pending``), and only once that committed is the first step sent. Each later step is
    released by the runtime once the step before it is verified (``recovery/runs.py``).

    Recorded one at a time, a first step sent before its later steps were recorded could settle
    while the run still looked one step long, and the run was settled ``completed`` with a step
    never run. A step id already published with other arguments refuses the whole run: nothing of
    it is recorded but that ``publish_refused`` event, and the conflict is raised."""
    run_ids = {e.run_id for e in envelopes}
    steps = [e.step for e in envelopes]
    if len(run_ids) != 1 or steps != list(range(len(envelopes))) or any(e.run_steps != len(envelopes)
                                                                           for e in envelopes):
        raise ValueError("a run is one run id with steps 0..n-1 in order, each envelope saying run_steps=n")
    # One trace for the run: its later steps are released from the trace of the step before them.
    with tracing.span("proofline.publish_run", **{"proofline.workflow": envelopes[0].workflow_type}), \
            _signed_batch(settings, conn, envelopes, None) as batch:
        try:
            with store.transaction(conn) as cur:
                recorded = _record_txn(cur, batch, envelopes, None, held=lambda e: e.step > 0)
                refused = next(((e, r) for e, r in zip(envelopes, recorded, strict=True)
                                if isinstance(r, IdempotencyConflict)), None)
                if refused is not None:
                    raise _RunRefused(*refused)  # rolls the whole run back
        except _RunRefused as exc:
            with store.transaction(conn) as cur:
                store.append_event_txn(cur, exc.envelope.action_id, "publish_refused", exc.envelope.requester,
                                       {**exc.conflict.as_evidence(), "run_id": exc.envelope.run_id})
            raise exc.conflict from None
        with tracing.current(batch.spans[0]), handed_to_broker(envelopes[0].action_id):
            CeleryDispatch(app, settings.tenant_shards).execute(batch.messages[0], task_id=recorded[0]["task_id"])
    return recorded  # no conflict gets this far


class _RunRefused(Exception):
    """Inside the run's transaction: a step conflicts, so nothing of the run is kept."""

    def __init__(self, envelope: Envelope, conflict: IdempotencyConflict) -> None:
        super().__init__(str(conflict))
        self.envelope, self.conflict = envelope, conflict

