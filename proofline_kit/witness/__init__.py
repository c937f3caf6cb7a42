"""An independent witness of side effects: a relay between the runtime and an MCP server that
records every ``tools/call`` it forwards, outside the ledger and outside the server process.

Run it in front of a stdio server (``python -m proofline_kit.witness stdio --log F --name N -- CMD``)
or a streamable-HTTP one (``python -m proofline_kit.witness http --upstream URL --log F ...``);
read what it saw with :class:`WitnessLog`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proofline_kit.witness.log import Call, WitnessLog

__all__ = ["Call", "WitnessLog"]


def __getattr__(name: str) -> Any:
    """The reader's classes, imported when first asked for: the relay (``python -m
    proofline_kit.witness``, one per sandboxed server a test starts) never reads a log."""
    if name in __all__:
        from proofline_kit.witness import log

        return getattr(log, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
