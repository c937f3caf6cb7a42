"""Build a recovery action's envelope (compensation, native rollback, forward fix) from the
recovery data the ledger recorded for the original action: its precondition snapshot, its
result and its last verification read. Never from a transcript or a model's memory."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ledger.redact import leaf_names
from ledger.store import ActionRow
from proofline.conditions import build_arguments
from proofline.contracts import Contract, DerivedAction, contract_for
from proofline.envelope import Envelope, build_envelope, derived_action_id
from proofline.errors import RecoveryContractUnknown
from proofline.keys import KeyRole, load_signing_key
from proofline.settings import Settings
from proofline.signing import message_hash, sign
from worker.runtime import Runtime

RECOVERY_IDENTITY = "proofline:recovery"


def recovery_variables(action: ActionRow, envelope: Envelope) -> dict[str, Any]:
    doc = envelope.model_dump(mode="json")
    data = action.recovery_data or {}
    return {"envelope": doc, "args": doc["arguments"], "target": doc["target"], "before": data.get("before") or {},
            "after": data.get("after") or {}, "result": (action.result or {}).get("values") or {}}


def recovery_signed_message(settings: Settings, envelope: Envelope) -> dict[str, Any]:
    """Sign a derived envelope with the recovery key: only recovery processes hold it."""
    return sign(envelope, load_signing_key(settings.recovery_key_file, KeyRole.recovery, settings.environment))


def recorded_tool_contract(rt: Runtime, parent_id: str, parent_server: str, contract: Contract) -> tuple[str, str]:
    """The server version and tool contract hash a recovery action is bound to: what the parent's
    last revalidation read live (``recovery_tools``). Recovery processes hold the recovery key and
    run no tool servers, so they never list tools themselves. A wrong recorded value cannot do harm:
    the executing worker compares it with the live server and refuses a mismatch."""
    if contract.server != parent_server:
        raise RecoveryContractUnknown(f"{contract.action_type} runs on server {contract.server}, not on the parent's "
                                      f"{parent_server}: no recorded contract to bind it to", action_id=parent_id)
    with rt.conn.cursor() as cur:
        cur.execute("SELECT evidence FROM ledger_events WHERE action_id = %s AND event = 'revalidated' "
                    "ORDER BY seq DESC LIMIT 1", (parent_id,))
        row = cur.fetchone()
    evidence = row["evidence"] if row else {}
    version, tool_hash = evidence.get("server_version"), (evidence.get("recovery_tools") or {}).get(contract.tool)
    if not isinstance(version, str) or not isinstance(tool_hash, str):
        raise RecoveryContractUnknown(f"the parent's revalidation recorded no live contract for {contract.tool}",
                                      action_id=parent_id, tool=contract.tool)
    return version, tool_hash


def derive_envelope(rt: Runtime, action: ActionRow, envelope: Envelope, spec: DerivedAction, kind: str,
                    deadline: timedelta = timedelta(minutes=10)) -> tuple[Envelope, Contract]:
    """The recovery action: its own id, key, lease, preconditions, verification and evidence.

    ``envelope`` is the parent's *verified* envelope (``authenticate_row``), never the row's copy;
    the derived one names the parent's signed message by hash, on the parent's tenant."""
    contract = contract_for(Path(rt.settings.contracts_dir), spec.action_type)
    variables = recovery_variables(action, envelope)
    target = {"type": contract.target_type, **build_arguments(spec.target, variables)}
    target["type"] = contract.target_type
    arguments = build_arguments(spec.arguments, variables)
    version, tool_hash = recorded_tool_contract(rt, action.action_id, envelope.server.name, contract)
    now = datetime.now(UTC)
    derived = build_envelope(
        run_id=f"{envelope.run_id}/recovery", action_id=derived_action_id(envelope.action_id, kind), step=0,
        run_steps=1, workflow_type="proofline.recovery", action_type=contract.action_type,
        requester=RECOVERY_IDENTITY, workload_identity=RECOVERY_IDENTITY, tenant=envelope.tenant,
        environment=envelope.environment, target=target, operation=contract.operation, arguments=arguments,
        server={"name": contract.server, "version": version},
        tool={"name": contract.tool, "contract_hash": tool_hash},
        policy_version=envelope.policy_version,
        # Authority: the original approval's compensation reference under the recovery policy.
        approval={"id": f"{envelope.approval.id}/{kind}", "version": envelope.approval.version,
                  "expires_at": now + deadline},
        timeout_seconds=contract.timeout_seconds, deadline=now + deadline,
        compensation_ref=envelope.compensation_ref or envelope.action_id, recovers=envelope.action_id,
        parent_message_hash=message_hash(action.signed_message or {}),
        # The original's declarations, plus what the recovery action's own contract declares.
        evidence=envelope.evidence.model_copy(update={"redact_fields": tuple(dict.fromkeys(
            (*envelope.evidence.redact_fields, *leaf_names(contract.sensitive_fields))))}),
    )
    return derived, contract
