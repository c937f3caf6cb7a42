"""What an agent sees of the gateway: one tool per action type it may use, and a status tool.

A governed tool takes ``target`` (the resource acted on: ``id``, and ``expected_version`` when the
agent read one) and ``arguments`` (the pinned input schema of the contract's write tool, so an
agent is offered exactly what an approver reviewed). Its answer is the proven outcome, never the
tool server's word: status, outcome, reason, verification finding, the action id and a console link.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mcp import types

from proofline.client import ActionResult
from proofline.contracts import Contract, contract_for
from proofline.pins import pinned_schema, pinned_tool, pins_path, read_pins
from proofline.settings import Settings

#: The read tool every agent has: the state of one of its own tenant's actions.
STATUS_TOOL = "proofline_action_status"
GOVERNED = ("Governed by Proofline: the call is revalidated against the system of record, executed at most "
            "once under an idempotency key and verified by an independent read. The answer is the proven "
            "outcome; 'proposed' means an approver must decide first (ask for it again with "
            f"{STATUS_TOOL}).")


def governed_tool(settings: Settings, action_type: str) -> tuple[types.Tool, Contract]:
    """The MCP tool for ``action_type``, with the pinned input schema of its write tool."""
    contract = contract_for(Path(settings.contracts_dir), action_type)
    path = pins_path(settings)
    pins = read_pins(path)
    pinned_tool(pins, contract, path)  # contract_not_pinned / unknown_tool, before an agent is offered it
    arguments = pinned_schema(pins, contract, path)
    target = {"type": "object", "required": ["id"],
              "properties": {"id": {"type": "string", "description": f"the {contract.target_type} acted on"},
                             "expected_version": {"type": ["string", "integer"],
                                                  "description": "the version the agent read; refused if it moved"}},
              "additionalProperties": False}
    schema = {"type": "object", "required": ["target", "arguments"], "additionalProperties": False,
              "properties": {"target": target, "arguments": arguments}}
    description = (f"{contract.operation} a {contract.target_type} ({contract.server}/{contract.tool}). {GOVERNED}")
    annotations = types.ToolAnnotations(read_only_hint=contract.operation == "read", open_world_hint=False,
                                        destructive_hint=contract.point_of_no_return or None)
    # A governed call may be answered as an MCP Task (proofline/gateway/tasks.py), never must be.
    return types.Tool(name=action_type, description=description, input_schema=schema, annotations=annotations,
                      execution=types.ToolExecution(task_support="optional")), contract


def status_tool() -> types.Tool:
    return types.Tool(name=STATUS_TOOL, description="The state of an action this agent published: status, outcome, "
                      "reason, verification finding.",
                      input_schema={"type": "object", "required": ["action_id"], "additionalProperties": False,
                                    "properties": {"action_id": {"type": "string"}}},
                      annotations=types.ToolAnnotations(read_only_hint=True, idempotent_hint=True))


def outcome_result(result: ActionResult, console_url: str | None) -> types.CallToolResult:
    """The proven outcome as the tool's answer; an error result unless verified, proposed or still running."""
    body: dict[str, Any] = {"action_id": result.action_id, "status": result.status.value,
                            "outcome": result.outcome.value if result.outcome else None,
                            "reason_code": result.reason_code, "finding": result.finding}
    if console_url:
        body["console"] = f"{console_url.rstrip('/')}/actions/{result.action_id}"
    if result.proposed:
        body["message"] = "proposed: waiting for an approver's decision"
    failed = result.settled and not result.verified and not result.proposed
    return types.CallToolResult(content=[types.TextContent(type="text", text=json.dumps(body))],
                                structured_content=body, is_error=failed)


def refusal(code: str, message: str, **extra: Any) -> types.CallToolResult:
    """A refusal before anything was published (nothing happened; the agent may correct and retry)."""
    body = {"refused": code, "message": message, **extra}
    return types.CallToolResult(content=[types.TextContent(type="text", text=json.dumps(body))],
                                structured_content=body, is_error=True)
