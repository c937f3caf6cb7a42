"""``proofline``: publish envelopes, read an action's status and timeline, check the ledger,
manage revocations, run migrations, workers and the demo."""

from __future__ import annotations

import json
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


def _dispatch():
    from worker.dispatch import CeleryDispatch
    from worker.tasks import app

    return CeleryDispatch(app)


@main.command()
@click.argument("action_id")
@click.option("--by", "who", required=True, help="who asks for the cancellation")
@click.option("--why", required=True)
def cancel(action_id: str, who: str, why: str) -> None:
    """Cancel an action: stop new work, signal an in-flight call, reconcile before calling it cancelled."""
    from recovery.cancel import cancel as do_cancel

    with _conn() as conn:
        click.echo(json.dumps(do_cancel(conn, _dispatch(), action_id, who, why)))


@main.group()
def kill() -> None:
    """Kill switches: per action type, tool, tenant, tool for one tenant (tool@tenant), or global."""


def _scope(value: str):
    from ledger.states import KillSwitchScope

    return KillSwitchScope(value)


def _switch_options(command):
    """--scope, --value, --by and --why: what every kill switch change records."""
    for option in reversed([
        click.option("--scope", type=click.Choice(["global", "action_type", "tool", "tenant", "tool_tenant"]),
                     required=True),
        click.option("--value", default="", help="e.g. a tool name, or tool@tenant"),
        click.option("--by", "who", required=True),
        click.option("--why", required=True),
    ]):
        command = option(command)
    return command


@kill.command("set")
@_switch_options
def kill_set(scope: str, value: str, who: str, why: str) -> None:
    from recovery.operator import set_switch

    with _conn() as conn:
        engaged = set_switch(conn, _scope(scope), value, who, why)
    click.echo(f"kill switch {scope}:{value} {'set' if engaged else 'was already set'}")


@kill.command("clear")
@_switch_options
def kill_clear(scope: str, value: str, who: str, why: str) -> None:
    from recovery.operator import clear_switch

    with _conn() as conn:
        cleared = clear_switch(conn, _scope(scope), value, who, why)
    click.echo(f"kill switch {scope}:{value} {'cleared' if cleared else 'was not set'}")


@kill.command("list")
def kill_list() -> None:
    from recovery.operator import list_switches

    with _conn() as conn:
        for row in list_switches(conn):
            click.echo(f"{row['scope']:<12} {row['value']:<30} {row['set_by']:<24} {row['set_at']:%Y-%m-%d %H:%M:%S}  "
                       f"{row['reason']}")


@main.group()
def manual() -> None:
    """The manual-intervention queue."""


@manual.command("list")
@click.option("--json", "as_json", is_flag=True)
def manual_list(as_json: bool) -> None:
    from recovery.operator import manual_queue

    with _conn() as conn:
        rows = manual_queue(conn)
    if as_json:
        click.echo(json.dumps(rows, default=str, indent=2))
        return
    for r in rows:
        click.echo(f"{r['action_id']:<32} {r['action_type']:<16} {r['tenant']:<10} {r['outcome'] or '-':<22} "
                   f"{r['reason_code'] or '-':<28} {r['recovery_kind'] or '-'}")


@manual.command("resolve")
@click.argument("action_id")
@click.option("--as", "resolution", type=click.Choice(["succeeded", "failed", "no_effect", "compensated"]),
              required=True)
@click.option("--by", "who", required=True)
@click.option("--reason", required=True)
@click.option("--evidence", default="{}", help="JSON: what the operator checked")
def manual_resolve(action_id: str, resolution: str, who: str, reason: str, evidence: str) -> None:
    from recovery.operator import resolve

    with _conn() as conn:
        resolve(conn, action_id, resolution, who, reason, json.loads(evidence))
    click.echo(f"{action_id} resolved as {resolution}")


@main.command()
@click.argument("run_id")
def run(run_id: str) -> None:
    """A multi-step run: its steps and the outcome derived from them."""
    from recovery.runs import load_steps, run_outcome

    with _conn() as conn, conn.cursor() as cur:
        steps = load_steps(cur, run_id)
    if not steps:
        raise click.ClickException(f"no run {run_id}")
    click.echo(f"run {run_id}: {run_outcome(steps)}")
    for st in steps:
        click.echo(f"  step {st.step}  {st.action_id:<32} {st.status.value:<10} "
                   f"{st.outcome.value if st.outcome else '-':<22} {st.reason_code or '-'}")


@main.command()
def reconcile() -> None:
    """Run one reconciler sweep now (Celery beat runs it periodically)."""
    from recovery.reconciler import sweep

    settings = get_settings()
    with _conn() as conn:
        counts = sweep(conn, _dispatch(), "cli:reconcile", stale_seconds=settings.redrive_after_seconds,
                       verify_stale_seconds=settings.verify_stall_seconds)
    click.echo(json.dumps(counts))


@main.command()
@click.argument("action_id")
def forensics(action_id: str) -> None:
    """Reconstruct an action and its recovery from the ledger alone."""
    from proofline.forensics import reconstruct

    with _conn() as conn, conn.cursor() as cur:
        text = reconstruct(cur, action_id)
    if text is None:
        raise click.ClickException(f"no ledger events for {action_id}")
    click.echo(text)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def soak(ctx: click.Context) -> None:
    """The chaos soak with its history checker (options: see `python -m ops.soak --help`)."""
    from proofline.settings import ROOT

    sys.path.insert(0, str(ROOT))  # ops/ and tests/ live in the checkout, not in the package
    from ops.soak import main as soak_main

    sys.exit(soak_main(list(ctx.args)))


@main.group()
def contracts() -> None:
    """Action contracts."""


@contracts.command("check")
@click.option("--dir", "directory", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="contracts directory (default: PROOFLINE_CONTRACTS_DIR)")
def contracts_check(directory: Path | None) -> None:
    """Load every contract file, with the condition limits; exit 1 naming each refused file and why."""
    from proofline.contracts import scan_contracts

    directory = directory or get_settings().contracts_dir
    if not Path(directory).is_dir():
        raise click.ClickException(f"{directory} is not a directory")
    loaded = scan_contracts(Path(directory))
    for action_type, contract in sorted(loaded.contracts.items()):
        click.echo(f"ok       {action_type} v{contract.version} {contract.digest[:12]}")
    for action_type, (name, reason) in sorted(loaded.broken.items()):
        click.echo(f"refused  {name} ({action_type}): {reason}", err=True)
    if loaded.broken:
        sys.exit(1)


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
    """Run a supervised Celery worker (prefork) on the given queues; extra options go to Celery.

    The worker is restarted if it dies (for example when the broker crashes under it)."""
    from proofline.supervise import supervise

    argv = [sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "-Q", queues, "-c", str(concurrency),
            "-P", "prefork", "--loglevel", "INFO", *ctx.args]
    sys.exit(supervise(argv))


@main.command()
@click.option("--keep", is_flag=True, help="leave the embedded Postgres running afterwards")
def demo(keep: bool) -> None:
    """Run the demo end to end (embedded Postgres and broker unless PROOFLINE_DATABASE_URL is set)."""
    from proofline.demo import run_demo

    sys.exit(run_demo(keep=keep))


if __name__ == "__main__":
    main()
