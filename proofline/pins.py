"""The pinned contract registry: the reviewed tool contract hash of every tool a contract names.

An approval covers a tool as it was reviewed: its name, schemas, description and annotations,
hashed (``proofline/canonical.py``). ``proofline contracts pin`` connects to each server once and
records those hashes here; the controller builds envelopes from this file and never starts a
server to publish. The worker still reads the live server and refuses an envelope whose pinned
hash no longer matches (``tool_contract_changed``), so a pin cannot hide a changed tool.

The file (``PROOFLINE_PINS_FILE``, default ``pins.json`` in the contracts directory) is JSON::

    {"format": 1,
     "servers": {"sor": {"version": "1.0.0", "pinned_at": "...", "pinned_by": "...",
                         "tools": {"issue_refund": "<sha256>", ...},
                         "input_schemas": {"issue_refund": {"type": "object", ...}, ...},
                         "available": ["get_account", "issue_refund", ...],
                         "protocol_version": "2026-07-28", "capabilities": {"tools": {...}}}}}

``tools`` holds the hashes of the tools the contracts name; ``input_schemas`` their input schemas
(part of what each hash covers), which ``publish`` checks the arguments against before signing
(``proofline/arguments.py``); ``available`` every tool the server listed, so a contract naming a
tool the server does not have is reported as ``unknown_tool`` without connecting again.
``protocol_version`` and ``capabilities`` are what the session negotiated when it was pinned: a
server that later speaks another protocol version or declares other capabilities (it starts
sending list-changed notifications, gains prompts, drops logging) is not the server that was
reviewed, and the worker refuses its actions as ``tool_contract_changed`` naming the change.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from proofline.contracts import Contract
from proofline.errors import ConfigurationError, ContractNotPinned, UnknownTool

FORMAT = 1


def pins_path(settings: Any) -> Path:
    """Where this deployment's pins live: ``settings.pins_file``, else next to the contracts."""
    return Path(settings.pins_file) if settings.pins_file else Path(settings.contracts_dir) / "pins.json"


@dataclass(frozen=True)
class ServerPin:
    """What was reviewed on one server: its version and the hash of each tool the contracts use."""

    version: str | None
    tools: dict[str, str]
    available: tuple[str, ...]
    pinned_at: str = ""
    pinned_by: str = ""
    #: The input schema of each pinned tool (a pin written before schemas were pinned has none).
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The protocol version negotiated when pinned (None: pinned before negotiation was recorded).
    protocol_version: str | None = None
    #: The capabilities the server declared when pinned, as JSON (None: not recorded).
    capabilities: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        negotiated = {"protocol_version": self.protocol_version, "capabilities": self.capabilities} \
            if self.protocol_version is not None else {}
        return {"version": self.version, "pinned_at": self.pinned_at, "pinned_by": self.pinned_by,
                "tools": dict(sorted(self.tools.items())), "input_schemas": dict(sorted(self.schemas.items())),
                "available": sorted(self.available), **negotiated}


def read_pins(path: Path) -> dict[str, ServerPin]:
    """Every server pin in ``path`` (empty when the file does not exist yet)."""
    path = Path(path)
    try:
        stamp = path.stat().st_mtime_ns
    except FileNotFoundError:
        return {}
    return _read(path, stamp)


@lru_cache(maxsize=8)
def _read(path: Path, stamp: int) -> dict[str, ServerPin]:
    # Keyed on the modification time: a long-lived controller sees a new pin without restarting.
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT}")
        return {name: ServerPin(version=spec.get("version"), tools=dict(spec["tools"]),
                                available=tuple(spec.get("available", spec["tools"])),
                                pinned_at=spec.get("pinned_at", ""), pinned_by=spec.get("pinned_by", ""),
                                schemas=dict(spec.get("input_schemas", {})),
                                protocol_version=spec.get("protocol_version"), capabilities=spec.get("capabilities"))
                for name, spec in raw["servers"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigurationError(f"pins file {path} is unreadable: {exc}", file=str(path)) from None


def write_pins(path: Path, pins: dict[str, ServerPin]) -> None:
    """Replace the pins file atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT, "servers": {name: pins[name].as_json() for name in sorted(pins)}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


def source_tools(contract: Contract, server: str) -> list[str]:
    """The evidence sources' read tools ``contract`` calls on ``server``."""
    return sorted({s.tool for s in contract.verification.all_sources
                   if contract.source_server(s) == server})


def calls_on(contract: Contract, server: str | None) -> list[tuple[str, str]]:
    """(field, tool) of every tool ``contract`` calls on ``server`` (its own by default): the write
    tool, the reads and the prepare tool on its own server (:meth:`Contract.tools_used`), and the
    read tools of its evidence sources on whichever server they name."""
    own = list(contract.tools_used()) if server is None or server == contract.server else []
    sources = [("verification.sources.tool", tool) for tool in source_tools(contract, server or contract.server)]
    return own + [pair for pair in sources if pair not in own]


def pin_server(contracts: list[Contract], live_version: str | None, live_hashes: dict[str, str],
               by: str, live_schemas: dict[str, dict[str, Any]] | None = None,
               server: str | None = None, negotiated: Negotiated | None = None) -> tuple[ServerPin, dict[str, str]]:
    """The pin for one server from what it listed now, and the contracts it cannot serve.

    ``contracts`` are those that call ``server`` (by default each contract's own): every tool they
    call there (:func:`calls_on`) is pinned, with its input schema. Returns the pin and
    ``{action_type: detail}`` for each contract naming a tool the server does not have."""
    unknown = {}
    for c in contracts:
        missing = [(where, tool) for where, tool in calls_on(c, server) if tool not in live_hashes]
        if missing:
            unknown[c.action_type] = unknown_tool_detail(c, live_hashes, missing, server)
    used = {tool for c in contracts for _, tool in calls_on(c, server) if tool in live_hashes}
    schemas = {tool: (live_schemas or {})[tool] for tool in used if tool in (live_schemas or {})}
    return ServerPin(version=live_version, tools={tool: live_hashes[tool] for tool in used},
                     available=tuple(sorted(live_hashes)), schemas=schemas,
                     pinned_at=datetime.now(UTC).isoformat(timespec="seconds"), pinned_by=by,
                     protocol_version=negotiated.protocol_version if negotiated else None,
                     capabilities=negotiated.capabilities if negotiated else None), unknown


@dataclass(frozen=True)
class Negotiated:
    """What one session agreed with a server: the protocol version and the server's capabilities."""

    protocol_version: str | None
    capabilities: dict[str, Any]


def negotiation_changes(pin: ServerPin | None, live: Negotiated) -> list[str]:
    """How ``live`` differs from what was pinned, one phrase per change (empty: as pinned, or the
    pin recorded no negotiation to compare with)."""
    if pin is None or pin.protocol_version is None:
        return []
    changes = []
    if live.protocol_version != pin.protocol_version:
        changes.append(f"protocol version {live.protocol_version!r}, pinned {pin.protocol_version!r}")
    pinned = pin.capabilities or {}
    for name in sorted(set(pinned) | set(live.capabilities)):
        if name not in live.capabilities:
            changes.append(f"capability {name} no longer declared")
        elif name not in pinned:
            changes.append(f"capability {name} newly declared ({json.dumps(live.capabilities[name], sort_keys=True)})")
        elif live.capabilities[name] != pinned[name]:
            changes.append(f"capability {name} is {json.dumps(live.capabilities[name], sort_keys=True)}, "
                           f"pinned {json.dumps(pinned[name], sort_keys=True)}")
    return changes


def missing_tools(contract: Contract, available: Any) -> list[tuple[str, str]]:
    """(field, tool) of each tool the contract uses on its own server that ``available`` does not hold."""
    return [(where, tool) for where, tool in contract.tools_used() if tool not in available]


def unknown_tool_detail(contract: Contract, available: Any, missing: list[tuple[str, str]] | None = None,
                        server: str | None = None) -> str:
    names = ", ".join(sorted(available)) or "none"
    missing = missing or missing_tools(contract, available) or [("tool", contract.tool)]
    named = ", ".join(f"{tool!r} ({where})" for where, tool in missing)
    return f"server {server or contract.server!r} has no tool {named} (it lists: {names})"


def pinned_tool(pins: dict[str, ServerPin], contract: Contract, path: Path) -> tuple[str | None, str]:
    """The reviewed server version and tool contract hash for ``contract``.

    Raises ``unknown_tool`` when the pinned server does not list the tool, and
    ``contract_not_pinned`` when the server or this tool was never pinned."""
    pin = pins.get(contract.server)
    if pin is None:
        raise ContractNotPinned(f"server {contract.server!r} is not pinned in {path}: run `proofline contracts "
                                f"pin` and review what it records", action_type=contract.action_type)
    if missing_tools(contract, pin.available):
        raise UnknownTool(unknown_tool_detail(contract, pin.available), action_type=contract.action_type)
    if contract.tool not in pin.tools:
        raise ContractNotPinned(f"tool {contract.tool!r} of server {contract.server!r} is not pinned in {path}: "
                                f"run `proofline contracts pin`", action_type=contract.action_type)
    return pin.version, pin.tools[contract.tool]


def pinned_schema(pins: dict[str, ServerPin], contract: Contract, path: Path) -> dict[str, Any]:
    """The pinned input schema of the contract's write tool (after :func:`pinned_tool` passed).

    Raises ``contract_not_pinned`` for a pin written before schemas were pinned."""
    schema = pins[contract.server].schemas.get(contract.tool)
    if schema is None:
        raise ContractNotPinned(f"the input schema of tool {contract.tool!r} of server {contract.server!r} is not "
                                f"pinned in {path}: run `proofline contracts pin` again", action_type=contract.action_type)
    return schema


def problems(pins: dict[str, ServerPin], contracts: dict[str, Contract], path: Path) -> dict[str, tuple[str, str]]:
    """``{action_type: (reason_code, detail)}`` for each contract the pins cannot serve: every tool it
    uses (write, reads, prepare) must be listed by the server and pinned."""
    found: dict[str, tuple[str, str]] = {}
    for action_type, contract in contracts.items():
        try:
            pinned_tool(pins, contract, path)
        except (UnknownTool, ContractNotPinned) as exc:
            found[action_type] = (exc.code, exc.detail)
            continue
        unpinned = [tool for _, tool in contract.tools_used() if tool not in pins[contract.server].tools]
        if unpinned:
            found[action_type] = ("contract_not_pinned", f"tool {unpinned[0]!r} of server {contract.server!r} is not "
                                                         f"pinned in {path}: run `proofline contracts pin`")
        if action_type not in found:
            problem = source_problem(pins, contract, path)
            if problem is not None:
                found[action_type] = problem
    return found


def source_problem(pins: dict[str, ServerPin], contract: Contract, path: Path) -> tuple[str, str] | None:
    """The first evidence source whose server was never pinned (``contract_not_pinned``) or does not
    list its read tool (``unknown_tool``), if any."""
    for source in contract.verification.all_sources:
        server = contract.source_server(source)
        pin = pins.get(server)
        if pin is None:
            return ("contract_not_pinned", f"server {server!r} of evidence source {source.name!r} is not pinned in "
                                           f"{path}: run `proofline contracts pin`")
        if source.tool not in pin.available:
            return ("unknown_tool", unknown_tool_detail(contract, pin.available,
                                                        [("verification.sources.tool", source.tool)], server))
    return None
