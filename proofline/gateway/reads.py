"""Read tools: ``<action type>.read`` answers a contract's own read of one target (``proofline/reads.py``).

The gateway never reads a system of record: it records the request on the chain
``read:<request id>`` as the controller role (who asked: the agent, its workload identity and
requester, its tenant; which contract; which target; the MCP request id), sends the signed
``proofline.read`` task, and polls that chain until a worker's answer is there (at most the
gateway's ``--wait``). The answer is the worker's, as recorded: the value redacted by the policy, or
``target_not_found`` for a target that is not the agent's tenant's (another tenant's target and a
missing one answer the same), or ``read_unavailable``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from mcp import types

from ledger import reads as read_store
from ledger import store
from proofline.client import celery_app
from proofline.contracts import contract_for
from proofline.gateway.agents import Agent
from proofline.gateway.tools import refusal
from proofline.keys import KeyRole, load_signing_key
from proofline.reads import SUFFIX, offers_read, sign_request
from proofline.settings import Settings, reveal

#: How often the gateway looks for the answer.
POLL_SECONDS = 0.1


def read_tool(settings: Settings, action_type: str) -> types.Tool | None:
    """The read tool of ``action_type``, or None when its contract offers no read to agents."""
    contract = contract_for(Path(settings.contracts_dir), action_type)
    if not offers_read(contract):
        return None
    schema = {"type": "object", "required": ["target"], "additionalProperties": False, "properties": {
        "target": {"type": "object", "required": ["id"], "additionalProperties": False, "properties": {
            "id": {"type": "string", "minLength": 1, "maxLength": 200,
                   "description": f"the {contract.target_type} to read"}}}}}
    description = (f"Read a {contract.target_type} of this agent's tenant as the {action_type} contract reads it "
                   f"({contract.server}/{contract.precondition_read.tool}, through a worker's read identity): the "
                   "system of record's current value, redacted. Changes nothing.")
    return types.Tool(name=f"{action_type}{SUFFIX}", description=description, input_schema=schema,
                      annotations=types.ToolAnnotations(read_only_hint=True, idempotent_hint=True,
                                                        destructive_hint=False, open_world_hint=False))


class Reader:
    """Records read requests, sends their tasks and waits for their answers (one connection per thread)."""

    def __init__(self, settings: Settings, wait_seconds: float) -> None:
        self.settings, self.wait_seconds = settings, wait_seconds
        self._url = reveal(settings.controller_database_url) or reveal(settings.database_url)
        self._local = threading.local()
        self._app: Any = None

    @property
    def conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            conn = self._local.conn = store.connect(self._url, application_name="proofline-gateway-reads")
        return conn

    def read(self, agent: Agent, action_type: str, args: dict[str, Any], mcp_request_id: Any) -> types.CallToolResult:
        target = args.get("target")
        if not isinstance(target, dict) or not isinstance(target.get("id"), str) or not target["id"] \
                or set(target) != {"id"}:
            return refusal("arguments_invalid", "give 'target' as an object with a string 'id' only")
        contract = contract_for(Path(self.settings.contracts_dir), action_type)
        if not offers_read(contract):
            return refusal("read_not_offered", f"{action_type!r} offers no read")
        request = {"request_id": uuid.uuid4().hex, "agent": agent.name, "workload_identity": agent.workload_identity,
                   "requester": agent.requester, "tenant": agent.tenant, "action_type": action_type,
                   "contract_version": contract.version, "contract_digest": contract.digest,
                   "target": {"type": contract.target_type, "id": target["id"][:200]},
                   "mcp_request_id": str(mcp_request_id)[:200]}
        key = load_signing_key(self.settings.signing_key_file, KeyRole.controller, self.settings.environment)
        message = sign_request(request, key)
        with store.transaction(self.conn) as cur:
            read_store.request_txn(cur, request, f"gateway:{agent.name}")
        self._dispatch().read(message, agent.tenant)
        answer = self._wait(request["request_id"])
        body: dict[str, Any] = {"request_id": request["request_id"], "action_type": action_type,
                                "target": request["target"]}
        if answer is None:
            return refusal("read_timed_out", f"no worker answered the read within {self.wait_seconds:g} s", **body)
        if not answer.get("found"):
            return refusal(str(answer.get("refused") or "read_unavailable"),
                           f"no value for {contract.target_type} {target['id'][:200]!r} of tenant {agent.tenant!r}",
                           **body)
        body["value"] = answer.get("value")
        return types.CallToolResult(content=[types.TextContent(type="text", text=json.dumps(body))],
                                    structured_content=body, is_error=False)

    def _wait(self, request_id: str) -> dict[str, Any] | None:
        deadline = time.monotonic() + self.wait_seconds
        while True:
            with self.conn.cursor() as cur:
                answer = read_store.state(cur, request_id)["answer"]
            if answer is not None or time.monotonic() >= deadline:
                return answer
            time.sleep(POLL_SECONDS)

    def _dispatch(self) -> Any:
        from worker.dispatch import CeleryDispatch

        if self._app is None:
            self._app = celery_app(self.settings, "proofline-gateway")
        return CeleryDispatch(self._app, self.settings.tenant_shards)
