"""``proofline``: the operator's command line. The commands live in ``proofline/commands/``, one
module per group; this module wires them into one group with ``--json``, ``--debug`` and
``--version``. Every error is one line on stderr with the exit code of its class
(``proofline/commands/exit_codes.py``)."""

from __future__ import annotations

import os

import click

from proofline.commands import (
    actions,
    authority_cmd,
    console_cmd,
    contracts_cmd,
    elicitations_cmd,
    evidence_cmd,
    gateway_cmd,
    init_cmd,
    ledger_cmds,
    operate,
    publish,
    runtime,
    servers_cmd,
)
from proofline.commands.base import MODE, ProoflineGroup, _set_debug, _set_json, to_json
from proofline.commands.contracts_cmd import contracts  # noqa: F401 - other modules add sub-commands to it
from proofline.commands.runtime import ROLE_QUEUES, role_queues  # noqa: F401 - used by tests and tools


def _version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        number = version("proofline")
    except PackageNotFoundError:
        number = "unknown (not installed)"
    click.echo(to_json({"version": number}) if MODE.json else f"proofline {number}")
    ctx.exit(0)


@click.group(cls=ProoflineGroup)
@click.option("--json", is_flag=True, expose_value=False, is_eager=True, callback=_set_json,
              help="print one JSON document on stdout (errors: one JSON line on stderr)")
@click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
              help="print the traceback of an error (also PROOFLINE_DEBUG=1)")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="print the version and exit")
def main() -> None:
    """Proofline: prove what an agent action changed before calling it done."""
    if os.environ.get("PROOFLINE_SENTRY_DSN"):  # errors of every command reach Sentry too
        from proofline.settings import get_settings
        from worker.observability import init_sentry

        init_sentry(get_settings())


for _module in (publish, actions, operate, ledger_cmds, contracts_cmd, runtime, console_cmd, authority_cmd,
                init_cmd, servers_cmd, gateway_cmd, evidence_cmd, elicitations_cmd):
    for _command in _module.COMMANDS:
        main.add_command(_command)

# Commands other modules contribute register below, one line each.

main.add_command(__import__("proofline.commands.beat", fromlist=["beat"]).beat)
main.add_command(__import__("proofline.commands.doctor", fromlist=["doctor"]).doctor)
import proofline.commands.pin  # noqa: E402,F401  (adds `contracts pin`)

main.add_command(__import__("proofline.telemetry.commands", fromlist=["exporter"]).exporter)
main.add_command(__import__("proofline.commands.retention_cmds", fromlist=["ledger"]).ledger)

if __name__ == "__main__":
    main()
