"""``proofline ledger``: retention and export (``prune``, ``hold``, ``export``).

Pruning connects as the pruning role (``PROOFLINE_PRUNER_DATABASE_URL``, role ``proofline_pruner``):
no runtime role may remove anything from the ledger. Export only reads.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import click

from proofline.commands.base import connect, emit, settings


@click.group()
def ledger() -> None:
    """Retention and export of the ledger (docs/how-to/retention-and-export.md)."""


@ledger.command()
@click.option("--dry-run", is_flag=True, help="count what would be pruned; remove nothing, record nothing")
def prune(dry_run: bool) -> None:
    """Prune whole settled chains older than their retention class allows, and delivery records,
    when the newest verified checkpoint anchors them; the heads removed are recorded in
    ``ledger:prunes`` so verify-ledger stays green."""
    from ledger.retention import prune as run

    with connect("pruner") as conn:
        done = run(conn, settings(), actor="cli:prune", dry_run=dry_run)
    verb = "would prune" if dry_run else "pruned"
    emit(done, lambda: (f"{verb} {done['chains']} chains ({done['events']} events) under checkpoint "
                        f"{done['checkpoint']}; skipped {done['skipped']}, not yet anchored {done['not_anchored']}, "
                        f"broken {done['broken']}\n"
                        + "\n".join(f"{verb} {n} rows of {t}" for t, n in done["tables"].items())))


@ledger.command()
@click.argument("action_id")
@click.option("--class", "retention_class", default="legal_hold", show_default=True,
              type=click.Choice(["short", "standard", "audit", "legal_hold"]))
@click.option("--reason", required=True, help="why (recorded on the action's chain)")
@click.option("--by", default="cli:operator", show_default=True, help="who sets it (recorded)")
def hold(action_id: str, retention_class: str, reason: str, by: str) -> None:
    """Give one action an explicit retention class: a legal hold (never pruned), or another class."""
    from ledger.retention import set_class
    from ledger.states import RetentionClass

    with connect("operator") as conn:
        set_class(conn, action_id, RetentionClass(retention_class), by, reason)
    emit({"action_id": action_id, "retention_class": retention_class},
         f"{action_id}: retention class {retention_class}")


@ledger.command()
@click.option("--format", "fmt", type=click.Choice(["jsonl", "parquet"]), default="jsonl", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="directory for the files")
@click.option("--since", type=click.DateTime(), default=None, help="from this time (UTC unless an offset is given)")
@click.option("--until", type=click.DateTime(), default=None, help="before this time")
def export(fmt: str, out: Path, since: datetime | None, until: datetime | None) -> None:
    """Write settled actions, events and evidence findings, one file per kind, with a versioned
    schema (docs/reference/export.md)."""
    from datetime import UTC

    from ledger.export import export as run

    since, until = (t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t for t in (since, until))
    with connect("reader") as conn:
        manifest = run(conn, out, fmt, since, until)
    emit(manifest, lambda: "\n".join(f"{k:<9} {v['rows']:>8} rows  {out / v['file']}"
                                     for k, v in manifest["files"].items()))


COMMANDS = (ledger,)
