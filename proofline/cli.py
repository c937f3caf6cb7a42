"""``proofline``: publish envelopes, read an action's status and timeline, check the ledger,
manage revocations, run migrations, workers and the demo."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from ledger import store
from proofline.settings import get_settings


def _conn():
    return store.connect(get_settings().database_url)


@click.group()
def main() -> None:
    """Proofline: prove what an agent action changed before calling it done."""


@main.command()
def migrate() -> None:
    """Apply the ledger's migrations (uses PROOFLINE_ADMIN_DATABASE_URL when set)."""
    from ledger.migrate import upgrade

    settings = get_settings()
    upgrade(settings.admin_database_url or settings.database_url)
    click.echo("ledger schema is at head")


@main.command()
@click.option("--action-type", required=True)
@click.option("--tenant", required=True)
@click.option("--target", "target_json", required=True, help='JSON, e.g. {"type":"ticket","id":"T-1","expected_version":2}')
@click.option("--args", "args_json", required=True, help="tool arguments as JSON")
@click.option("--run-id", required=True)
@click.option("--action-id", required=True)
@click.option("--requester", default="operator@example.com")
@click.option("--workload-identity", default="agent:ops-assistant")
def publish(action_type, tenant, target_json, args_json, run_id, action_id, requester, workload_identity) -> None:
    """Build, sign and publish one envelope onto the actions queue."""
    from proofline.controller import prepare
    from proofline.controller import publish as do_publish
    from worker.tasks import app

    settings = get_settings()
    envelope = prepare(settings, action_type=action_type, arguments=json.loads(args_json),
                       target=json.loads(target_json), tenant=tenant, run_id=run_id, action_id=action_id,
                       requester=requester, workload_identity=workload_identity)
    with _conn() as conn:
        click.echo(json.dumps(do_publish(settings, conn, app, envelope)))


@main.command()
@click.argument("action_id")
@click.option("--timeline/--no-timeline", default=True, help="also print the ledger events")
@click.option("--json", "as_json", is_flag=True)
def status(action_id: str, timeline: bool, as_json: bool) -> None:
    """An action's current state and its ledger timeline."""
    from proofline.report import action_report

    with _conn() as conn, conn.cursor() as cur:
        report = action_report(cur, action_id)
    if report is None:
        raise click.ClickException(f"no action {action_id}")
    if as_json:
        click.echo(json.dumps(report, default=str, indent=2))
        return
    from proofline.report import render_report

    click.echo(render_report(report, timeline=timeline))


@main.command("verify-ledger")
def verify_ledger() -> None:
    """Recompute every hash chain; exit 1 and name the first broken link of each broken chain."""
    from proofline.ledger_check import check_chains

    with _conn() as conn:
        chains, events, broken = check_chains(conn)
    click.echo(f"{chains} chains, {events} events checked")
    for link in broken:
        click.echo(f"BROKEN {link.action_id} at seq {link.seq}: {link.problem}")
    if broken:
        sys.exit(1)
    click.echo("every chain verifies")


@main.command()
@click.argument("identity")
@click.option("--by", required=True)
@click.option("--reason", required=True)
def revoke(identity: str, by: str, reason: str) -> None:
    """Revoke a requester or workload identity: its queued actions will not start."""
    with _conn() as conn, store.transaction(conn) as cur:
        store.revoke_identity_txn(cur, identity, by, reason)
    click.echo(f"revoked {identity}")


@main.command("envelope-schema")
@click.option("--out", type=click.Path(path_type=Path), default=Path("schemas/envelope.v1.json"))
def envelope_schema(out: Path) -> None:
    """Write the envelope's JSON Schema."""
    from proofline.envelope import Envelope

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(Envelope.model_json_schema(), indent=2, sort_keys=True) + "\n")
    click.echo(f"wrote {out}")


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--queues", default="actions,verify,compensate,reconcile")
@click.option("--concurrency", default=2)
@click.pass_context
def worker(ctx: click.Context, queues: str, concurrency: int) -> None:
    """Run a Celery worker (prefork) on the given queues; extra options go to Celery."""
    argv = [sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "-Q", queues, "-c", str(concurrency),
            "-P", "prefork", "--loglevel", "INFO", *ctx.args]
    os.execv(sys.executable, argv)


@main.command()
@click.option("--keep", is_flag=True, help="leave the embedded Postgres running afterwards")
def demo(keep: bool) -> None:
    """Run the demo end to end (embedded Postgres and broker unless PROOFLINE_DATABASE_URL is set)."""
    from proofline.demo import run_demo

    sys.exit(run_demo(keep=keep))


if __name__ == "__main__":
    main()
