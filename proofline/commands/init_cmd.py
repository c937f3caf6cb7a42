"""``proofline init`` (a deployment folder) and ``proofline dev`` (its whole stack in one terminal)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from proofline.commands.base import emit, foreground, refuse_json


@click.command("init")
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False))
@click.option("--approver", default=None,
              help="the identity of the approver key made for you (default: user@host)")
@click.option("--force", is_flag=True, help="write into a folder that is not empty (its keys are replaced)")
def init(directory: Path, approver: str | None, force: bool) -> None:
    """Make a deployment folder: keys per role, a servers file and a contract template, a signed
    authority policy, .env, systemd units and a compose file. Refuses a non-empty folder
    (init_folder_not_empty) unless --force."""
    from proofline.scaffold import init as do_init
    from proofline.scaffold import next_commands

    layout = do_init(directory, approver=approver, force=force)
    commands = next_commands(layout)
    emit({"folder": str(layout.root), "next": commands},
         "\n".join([f"made a deployment folder in {layout.root}", "next:", *(f"  {c}" for c in commands)]))


@foreground
@click.command("dev")
@click.option("--dir", "directory", type=click.Path(path_type=Path, file_okay=False), default=Path("."),
              show_default=True, help="the folder `proofline init` made")
@click.option("--console-port", type=click.IntRange(1, 65535), default=8470, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=9465, show_default=True)
def dev(directory: Path, console_port: int, metrics_port: int) -> None:
    """Run the folder's whole stack on this machine until Ctrl-C: embedded Postgres (in the folder)
    as database and broker, migrations, worker with beat, console (a login token is printed) and the
    metrics exporter. SIGINT or SIGTERM stops every process it started."""
    refuse_json("dev")
    from proofline_kit.devstack import run_dev  # the dev stack is part of the kit

    sys.exit(run_dev(directory, console_port=console_port, metrics_port=metrics_port,
                     say=lambda line: click.echo(line, err=False)))


COMMANDS = (init, dev)
