"""``proofline contracts pin``: record the reviewed tool contract hashes the controller publishes with.

It connects to each server the contracts name once, hashes the tools they use (the write tool, the
precondition read and the verification reads), keeps their input schemas and writes the pinned
contract registry (``proofline/pins.py``). ``--check`` compares the registry with the live
servers and writes nothing: a changed tool is a new review, not a silent re-pin.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from proofline.cli import contracts
from proofline.settings import get_settings


@contracts.command("pin")
@click.option("--server", "only", multiple=True, help="pin only this server (repeatable)")
@click.option("--by", "who", default="operator", show_default=True, help="who reviewed what is pinned")
@click.option("--check", is_flag=True, help="compare the pins with the live servers; write nothing")
def pin(only: tuple[str, ...], who: str, check: bool) -> None:
    """Connect to each server once and pin the contract hash and input schema of every tool a
    contract uses (its write tool and its reads); exit 1 naming each contract using a tool the server
    does not have (unknown_tool)."""
    from proofline.contracts import scan_contracts
    from proofline.controller import describe_negotiated
    from proofline.errors import ConfigurationError, ProoflineError
    from proofline.pins import pin_server, pins_path, read_pins, write_pins

    settings = get_settings()
    loaded = scan_contracts(Path(settings.contracts_dir))
    by_server: dict[str, list] = {}
    for contract in loaded.contracts.values():
        # A contract is pinned on its own server and checked on each server its evidence sources read.
        for server in sorted({contract.server, *contract.read_tools()}):
            if not only or server in only:
                by_server.setdefault(server, []).append(contract)
    if not by_server:
        raise click.ClickException(f"no contract in {settings.contracts_dir} names "
                                   f"{'server ' + ', '.join(only) if only else 'a server'}")
    path = pins_path(settings)
    try:
        pins = dict(read_pins(path))
        failed = False
        for server, named in sorted(by_server.items()):
            version, hashes, schemas, negotiated = describe_negotiated(settings, server)
            fresh, unknown = pin_server(named, version, hashes, who, schemas, server, negotiated)
            for contract in named:
                if contract.action_type in unknown:
                    failed = True
                    click.echo(f"unknown_tool  {contract.action_type}: {unknown[contract.action_type]}", err=True)
            if check:
                failed |= _compare(server, pins.get(server), fresh)
            else:
                pins[server] = fresh
                tools = ", ".join(f"{tool} {digest[:12]}" for tool, digest in sorted(fresh.tools.items()))
                click.echo(f"pinned  {server} {version}: {tools}")
    except ConfigurationError:
        raise  # a servers file or pins file that does not load: configuration_error, exit 3
    except ProoflineError as exc:
        raise click.ClickException(str(exc)) from None
    if not check:
        write_pins(path, pins)
        click.echo(f"wrote {path}")
    if failed:
        sys.exit(1)


def _compare(server: str, pinned, live) -> bool:
    """Print how the live server differs from its pin; True when it does."""
    if pinned is None:
        click.echo(f"unpinned  {server}", err=True)
        return True
    changed = False
    if pinned.version != live.version:
        click.echo(f"changed  {server}: version pinned {pinned.version} live {live.version}", err=True)
        changed = True
    from proofline.pins import Negotiated, negotiation_changes

    for change in negotiation_changes(pinned, Negotiated(live.protocol_version, live.capabilities or {})):
        click.echo(f"changed  {server}: {change}", err=True)
        changed = True
    if pinned.protocol_version is None:
        # Pinned before negotiation was recorded: workers compare nothing until it is pinned again.
        click.echo(f"unpinned_negotiation  {server}: protocol and capabilities not compared; "
                   "run `proofline contracts pin` to record them", err=True)
    for tool, digest in sorted(live.tools.items()):
        if pinned.tools.get(tool) != digest:
            click.echo(f"changed  {server}/{tool}: pinned {str(pinned.tools.get(tool))[:12]} live {digest[:12]}",
                       err=True)
            changed = True
        elif tool in live.schemas and tool not in pinned.schemas:
            # Pinned before input schemas were: publish cannot check arguments until it is pinned again.
            click.echo(f"unpinned_schema  {server}/{tool}: run `proofline contracts pin` again", err=True)
            changed = True
    if not changed:
        click.echo(f"ok  {server} {live.version}: {len(live.tools)} tools as pinned")
    return changed
