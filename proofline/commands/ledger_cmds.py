"""The ledger's own commands: ``migrate``, ``verify-ledger``, ``checkpoint``, ``reconcile``,
``envelope-schema``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from proofline.commands.base import MODE, connect, emit, settings, to_json
from proofline.commands.exit_codes import CHECK_FAILED


@click.command()
def migrate() -> None:
    """Apply the ledger's migrations (uses PROOFLINE_ADMIN_DATABASE_URL when set)."""
    import sqlalchemy.exc

    from ledger.migrate import upgrade
    from proofline.errors import DatabaseUnavailable
    from proofline.settings import reveal

    s = settings()
    try:
        upgrade(reveal(s.admin_database_url) or reveal(s.database_url))
    except sqlalchemy.exc.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to migrate the ledger database: {exc.orig}") from None
    emit({"schema": "head"}, "ledger schema is at head")


@click.command("verify-ledger")
def verify_ledger() -> None:
    """Recompute every hash chain and compare it with the signed checkpoints; exit 1 and name the
    first broken link of each broken chain (and of the checkpoint series)."""
    from ledger.anchor_check import verify_ledger as check

    with connect("reader") as conn:
        report = check(conn, settings())
    if MODE.json:
        click.echo(to_json(report.as_json()))
        sys.exit(0 if report.ok else CHECK_FAILED)
    click.echo(f"{report.chains} chains, {report.events} events checked")
    if report.checkpoint:
        cp = report.checkpoint
        click.echo(f"against checkpoint {cp['number']} ({cp['created_at']}, key {cp['key_id']}): "
                   f"{cp['chains']} chains, {cp['events']} events anchored")
    for note in report.notes:
        click.echo(note)
    for link in report.broken:
        click.echo(f"BROKEN {link.action_id} at seq {link.seq}: {link.problem}")
    if report.broken:
        sys.exit(CHECK_FAILED)
    click.echo("every chain verifies")


@click.command()
def checkpoint() -> None:
    """Write one signed ledger checkpoint now (Celery beat runs this on the checkpoint queue)."""
    from ledger.checkpoint import write_checkpoint

    with connect() as conn:
        written = write_checkpoint(conn, settings(), actor="cli:checkpoint")
    emit(written, lambda: "checkpoint " + " ".join(f"{k}={v}" for k, v in written.items()))


@click.command()
def reconcile() -> None:
    """Run one reconciler sweep now (Celery beat runs it periodically)."""
    from proofline.commands.operate import dispatcher
    from recovery.reconciler import sweep

    s = settings()
    with connect() as conn:
        counts = sweep(conn, dispatcher(), "cli:reconcile", stale_seconds=s.redrive_after_seconds,
                       verify_stale_seconds=s.verify_stall_seconds, backlog_max_seconds=s.redrive_backlog_max_seconds,
                       shards=s.tenant_shards)
    emit(counts, lambda: "\n".join(f"{name:<24} {n}" for name, n in counts.items())
         + ("" if any(counts.values()) else "\nnothing to re-drive"))


@click.command("envelope-schema")
@click.option("--out", type=click.Path(path_type=Path), default=Path("schemas/envelope.v1.json"))
def envelope_schema(out: Path) -> None:
    """Write the envelope's JSON Schema."""
    from proofline.envelope import Envelope

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(Envelope.model_json_schema(), indent=2, sort_keys=True) + "\n")
    emit({"wrote": out}, f"wrote {out}")


COMMANDS = (migrate, verify_ledger, checkpoint, reconcile, envelope_schema)
