"""An independent witness of side effects: a relay between the runtime and an MCP server that
records every ``tools/call`` it forwards, outside the ledger and outside the server process.

Run it in front of a stdio server (``python -m proofline_kit.witness stdio --log F --name N -- CMD``)
or a streamable-HTTP one (``python -m proofline_kit.witness http --upstream URL --log F ...``);
read what it saw with :class:`WitnessLog`.
"""

from proofline_kit.witness.log import Call, WitnessLog

__all__ = ["Call", "WitnessLog"]
