"""``proofline contracts``: check a contracts folder file by file."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from proofline.commands.base import MODE, emit, settings
from proofline.commands.exit_codes import CHECK_FAILED


@click.group()
def contracts() -> None:
    """Action contracts."""


@contracts.command("check")
@click.option("--dir", "directory", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="contracts directory (default: PROOFLINE_CONTRACTS_DIR)")
def contracts_check(directory: Path | None) -> None:
    """Load every contract file on its own, with the condition limits; exit 1 naming each refused
    file, the field and why, each tool a contract uses (write tool, precondition and verification
    reads) that the pinned server does not list (unknown_tool), and each recovery naming an action
    type with no contract (unknown_action_type). A broken file refuses only its own action type."""
    from proofline.contracts import scan_contracts
    from proofline.errors import ConfigurationError

    directory = Path(directory or settings().contracts_dir)
    if not directory.is_dir():
        raise ConfigurationError(f"contracts directory {directory} does not exist")
    loaded = scan_contracts(directory)
    ok = [{"action_type": a, "version": c.version, "tool": c.tool, "digest": c.digest}
          for a, c in sorted(loaded.contracts.items())]
    refused = [{"action_type": a, "file": name, "reason": reason} for a, (name, reason) in sorted(loaded.broken.items())]
    if not ok and not refused:
        emit({"directory": directory, "ok": [], "refused": []}, f"no contract files (*.yaml) in {directory}")
        sys.exit(CHECK_FAILED)
    from proofline.pins import problems, read_pins

    pins = settings().pins_file or directory / "pins.json"
    unpinnable = problems(read_pins(pins), loaded.contracts, pins)
    unpinnable.update(unknown_servers(loaded.contracts))
    pin_problems = [{"action_type": a, "code": code, "detail": detail} for a, (code, detail) in sorted(unpinnable.items())]
    # A recovery names another action type: the recovery runs that contract, with its tools.
    pin_problems += [{"action_type": a, "code": "unknown_action_type",
                      "detail": f"{where} {derived!r} has no contract in {directory}"}
                     for a, c in sorted(loaded.contracts.items()) for where, derived in c.recovery_action_types()
                     if derived not in loaded.contracts]
    emit({"directory": directory, "ok": ok, "refused": refused, "pins": pin_problems}, lambda: "\n".join(
        f"ok       {c['action_type']:<20} v{c['version']} tool {c['tool']:<20} {c['digest'][:12]}" for c in ok))
    if not MODE.json:
        for r in refused:  # the problems, one line per refused file, on stderr
            click.echo(f"refused  {r['file']} ({r['action_type']}): {r['reason']}", err=True)
        for q in pin_problems:  # an unknown tool or recovery fails the check; a missing pin is a warning
            click.echo(f"{q['code']}  {q['action_type']}: {q['detail']}", err=True)
    if refused or any(q["code"] in ("unknown_tool", "unknown_action_type", "unknown_server") for q in pin_problems):
        sys.exit(CHECK_FAILED)


def unknown_servers(contracts: dict) -> dict[str, tuple[str, str]]:
    """``{action_type: ("unknown_server", detail)}`` for each contract whose evidence source names a
    server the servers file does not define (checked only when the servers file exists)."""
    from proofline.errors import UnknownServer
    from worker.servers import load_servers

    path = Path(settings().servers_file)
    if not path.is_file():
        return {}
    defined = load_servers(path)
    found = {}
    for action_type, contract in contracts.items():
        missing = sorted({contract.source_server(s) for s in contract.verification.all_sources} - set(defined))
        if missing:
            found[action_type] = (UnknownServer.code, f"evidence source server {missing[0]!r} is not in the "
                                                      f"servers file {path}")
    return found


COMMANDS = (contracts,)
