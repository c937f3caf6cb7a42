"""The pinned contract registry and the worker's live comparison (pure logic; the stack tests run
them against real servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proofline.contracts import contract_for
from proofline.errors import ConfigurationError, ContractNotPinned, ToolContractChanged, UnknownTool
from proofline.pins import pin_server, pinned_schema, pinned_tool, problems, read_pins, write_pins
from proofline.settings import ROOT
from worker.validate import revalidate_live

CONTRACTS = ROOT / "contracts"


SCHEMA = {"type": "object", "required": ["title"], "properties": {"title": {"type": "string"}}}


def test_pins_round_trip_and_serve_the_contracts_tool(tmp_path: Path) -> None:
    contract = contract_for(CONTRACTS, "ticket.create")
    live = {"create_ticket": "a" * 64, "find_ticket_by_key": "f" * 64, "get_ticket": "b" * 64}
    pin, unknown = pin_server([contract], "1.0.0", live, "rev", {"create_ticket": SCHEMA, "get_ticket": {}})
    # Every tool the contract uses (its write tool and its precondition read), and nothing else.
    assert unknown == {} and pin.tools == {"create_ticket": "a" * 64, "find_ticket_by_key": "f" * 64}
    assert pin.schemas == {"create_ticket": SCHEMA}
    path = tmp_path / "pins.json"
    write_pins(path, {"sor": pin})
    assert pinned_tool(read_pins(path), contract, path) == ("1.0.0", "a" * 64)
    assert pinned_schema(read_pins(path), contract, path) == SCHEMA


def test_a_misspelled_read_tool_is_an_unknown_tool_naming_its_field(tmp_path: Path) -> None:
    contract = contract_for(CONTRACTS, "ticket.create")
    read = contract.precondition_read.model_copy(update={"tool": "find_tiket_by_key"})
    contract = contract.model_copy(update={"precondition_read": read})
    pin, unknown = pin_server([contract], "1.0.0", {"create_ticket": "a" * 64, "find_ticket_by_key": "f" * 64}, "rev")
    assert "'find_tiket_by_key' (precondition_read.tool)" in unknown["ticket.create"]
    path = tmp_path / "pins.json"
    assert problems({"sor": pin}, {"ticket.create": contract}, path)["ticket.create"][0] == "unknown_tool"


def test_a_pin_without_schemas_is_not_publishable(tmp_path: Path) -> None:
    """A pins file written before input schemas were pinned: the arguments cannot be checked."""
    contract = contract_for(CONTRACTS, "ticket.create")
    pin, _ = pin_server([contract], "1.0.0", {"create_ticket": "a" * 64, "find_ticket_by_key": "f" * 64}, "rev")
    path = tmp_path / "pins.json"
    write_pins(path, {"sor": pin})
    with pytest.raises(ContractNotPinned, match="input schema of tool 'create_ticket'"):
        pinned_schema(read_pins(path), contract, path)


def test_a_missing_tool_and_a_missing_pin_have_their_own_codes(tmp_path: Path) -> None:
    contract = contract_for(CONTRACTS, "ticket.create").model_copy(update={"tool": "create_tiket"})
    pin, unknown = pin_server([contract], "1.0.0", {"create_ticket": "a" * 64}, "rev")
    assert "no tool 'create_tiket'" in unknown["ticket.create"] and "create_ticket" in unknown["ticket.create"]
    path = tmp_path / "pins.json"
    with pytest.raises(ContractNotPinned):
        pinned_tool({}, contract, path)
    with pytest.raises(UnknownTool) as raised:
        pinned_tool({"sor": pin}, contract, path)
    assert raised.value.code == "unknown_tool"
    assert problems({"sor": pin}, {"ticket.create": contract}, path)["ticket.create"][0] == "unknown_tool"


def test_a_pins_file_of_another_format_is_a_configuration_error(tmp_path: Path) -> None:
    path = tmp_path / "pins.json"
    path.write_text('{"format": 99, "servers": {}}')
    with pytest.raises(ConfigurationError) as raised:
        read_pins(path)
    assert "format 99" in raised.value.detail


def test_the_worker_names_a_tool_the_live_server_does_not_have() -> None:
    class Named:  # the comparison reads only these fields of an envelope
        def __init__(self, **kw):
            self.__dict__.update(kw)

    envelope = Named(server=Named(name="sor", version="1.0.0"), tool=Named(name="create_tiket", contract_hash="a" * 64))
    with pytest.raises(UnknownTool) as raised:
        revalidate_live(envelope, "1.0.0", None, {"create_ticket": "a" * 64})
    assert "create_tiket" in raised.value.detail and "create_ticket" in raised.value.detail
    envelope.tool.name = "create_ticket"
    envelope.tool.contract_hash = "c" * 64
    with pytest.raises(ToolContractChanged):
        revalidate_live(envelope, "1.0.0", None, {"create_ticket": "a" * 64})


def test_evidence_sources_are_checked_on_their_own_servers(tmp_path: Path) -> None:
    """A source on another server: that server is pinned for the contract too, and must list the
    source's read tool; its write server's pin is unchanged by it."""
    from proofline.contracts import EvidenceSource

    base = contract_for(CONTRACTS, "ticket.create")
    audit = EvidenceSource(name="audit", server="audit", tool="find_audit_entries",
                           arguments={"idempotency_key": "envelope.idempotency_key"}, expected=("after.found",))
    contract = base.model_copy(update={"verification": base.verification.model_copy(update={"sources": (audit,)})})
    path = tmp_path / "pins.json"
    live = {"create_ticket": "a" * 64, "find_ticket_by_key": "b" * 64}
    sor, _ = pin_server([contract], "1.0.0", live, "rev", server="sor")
    assert sor.tools == live
    code, detail = problems({"sor": sor}, {"ticket.create": contract}, path)["ticket.create"]
    assert code == "contract_not_pinned" and "'audit'" in detail
    bare, unknown = pin_server([contract], "0.1.0", {"service_health": "c" * 64}, "rev", server="audit")
    assert bare.tools == {} and "verification.sources.tool" in unknown["ticket.create"]
    code, detail = problems({"sor": sor, "audit": bare}, {"ticket.create": contract}, path)["ticket.create"]
    assert code == "unknown_tool" and "find_audit_entries" in detail
    full, unknown = pin_server([contract], "0.1.0", {"find_audit_entries": "d" * 64}, "rev", server="audit")
    assert unknown == {} and problems({"sor": sor, "audit": full}, {"ticket.create": contract}, path) == {}


def test_each_change_of_the_negotiation_is_named() -> None:
    from proofline.pins import Negotiated, ServerPin, negotiation_changes

    pin = ServerPin(version="1", tools={}, available=(), protocol_version="2026-07-28",
                    capabilities={"tools": {"listChanged": True}, "logging": {}})
    assert negotiation_changes(pin, Negotiated("2026-07-28", {"tools": {"listChanged": True}, "logging": {}})) == []
    changes = negotiation_changes(pin, Negotiated("2025-11-25", {"tools": {}, "prompts": {"listChanged": True}}))
    assert changes == ["protocol version '2025-11-25', pinned '2026-07-28'", "capability logging no longer declared",
                       'capability prompts newly declared ({"listChanged": true})',
                       'capability tools is {}, pinned {"listChanged": true}']
    # A pin from before negotiation was recorded compares nothing (and no pin at all neither).
    assert negotiation_changes(ServerPin(version="1", tools={}, available=()), Negotiated("x", {})) == []
    assert negotiation_changes(None, Negotiated("x", {})) == []
