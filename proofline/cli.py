"""``proofline``: publish envelopes, read an action's status and timeline, check the ledger,
manage revocations, run migrations, workers and the demo."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from ledger import store
from proofline.settings import get_settings, reveal


def _conn(role: str | None = None):
    """A connection as this command's database role: ``controller``, ``operator`` or ``reader`` use
    their own URL when configured; everything else (and an unset URL) uses ``database_url``."""
    settings = get_settings()
    url = getattr(settings, f"{role}_database_url") if role else None
    return store.connect(reveal(url) or reveal(settings.database_url))


@click.group()
def main() -> None:
    """Proofline: prove what an agent action changed before calling it done."""
    if os.environ.get("PROOFLINE_SENTRY_DSN"):  # errors of every command reach Sentry too
        from worker.observability import init_sentry

        init_sentry(get_settings())


@main.command()
def migrate() -> None:
    """Apply the ledger's migrations (uses PROOFLINE_ADMIN_DATABASE_URL when set)."""
    from ledger.migrate import upgrade

    settings = get_settings()
    upgrade(reveal(settings.admin_database_url) or reveal(settings.database_url))
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
    from proofline.errors import ConfigurationError
    from proofline.keys import check_process_keys
    from worker.tasks import app

    settings = get_settings()
    try:
        check_process_keys(settings, "controller")  # before anything is recorded
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    envelope = prepare(settings, action_type=action_type, arguments=json.loads(args_json),
                       target=json.loads(target_json), tenant=tenant, run_id=run_id, action_id=action_id,
                       requester=requester, workload_identity=workload_identity)
    with _conn("controller") as conn:
        click.echo(json.dumps(do_publish(settings, conn, app, envelope)))


@main.command()
@click.argument("action_id")
@click.option("--timeline/--no-timeline", default=True, help="also print the ledger events")
@click.option("--json", "as_json", is_flag=True)
def status(action_id: str, timeline: bool, as_json: bool) -> None:
    """An action's current state and its ledger timeline."""
    from proofline.report import action_report

    with _conn("reader") as conn, conn.cursor() as cur:
        report = action_report(cur, action_id)
    if report is None:
        raise click.ClickException(f"no action {action_id}")
    if as_json:
        click.echo(json.dumps(report, default=str, indent=2))
        return
    from proofline.report import render_report

    click.echo(render_report(report, timeline=timeline))


@main.command("verify-ledger")
@click.option("--json", "as_json", is_flag=True)
def verify_ledger(as_json: bool) -> None:
    """Recompute every hash chain and compare it with the signed checkpoints; exit 1 and name the
    first broken link of each broken chain (and of the checkpoint series)."""
    from ledger.anchor_check import verify_ledger as check

    settings = get_settings()
    with _conn("reader") as conn:
        report = check(conn, settings)
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2))
        sys.exit(0 if report.ok else 1)
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
        sys.exit(1)
    click.echo("every chain verifies")


@main.command()
def checkpoint() -> None:
    """Write one signed ledger checkpoint now (Celery beat runs this on the checkpoint queue)."""
    from ledger.checkpoint import write_checkpoint
    from proofline.errors import ProoflineError

    settings = get_settings()
    with _conn() as conn:
        try:
            click.echo(json.dumps(write_checkpoint(conn, settings, actor="cli:checkpoint")))
        except ProoflineError as exc:
            raise click.ClickException(str(exc)) from None


@main.command()
@click.argument("identity")
@click.option("--by", required=True)
@click.option("--reason", required=True)
def revoke(identity: str, by: str, reason: str) -> None:
    """Revoke a requester or workload identity: its queued actions will not start."""
    with _conn("operator") as conn, store.transaction(conn) as cur:
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

    with _conn("operator") as conn:
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

    with _conn("operator") as conn:
        engaged = set_switch(conn, _scope(scope), value, who, why)
    click.echo(f"kill switch {scope}:{value} {'set' if engaged else 'was already set'}")


@kill.command("clear")
@_switch_options
def kill_clear(scope: str, value: str, who: str, why: str) -> None:
    from recovery.operator import clear_switch

    with _conn("operator") as conn:
        cleared = clear_switch(conn, _scope(scope), value, who, why)
    click.echo(f"kill switch {scope}:{value} {'cleared' if cleared else 'was not set'}")


@kill.command("list")
def kill_list() -> None:
    from recovery.operator import list_switches

    with _conn("reader") as conn:
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

    with _conn("reader") as conn:
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

    with _conn("operator") as conn:
        resolve(conn, action_id, resolution, who, reason, json.loads(evidence))
    click.echo(f"{action_id} resolved as {resolution}")


@main.command()
@click.argument("run_id")
def run(run_id: str) -> None:
    """A multi-step run: its steps and the outcome derived from them."""
    from recovery.runs import load_steps, run_outcome

    with _conn("reader") as conn, conn.cursor() as cur:
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

    with _conn("reader") as conn, conn.cursor() as cur:
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


#: What each kind of worker process consumes. Execution never holds the recovery key; recovery
#: (deciding, deriving and signing recovery envelopes, and the reconciler) runs no execute tasks.
#: ``actions`` stands for every tenant shard of the execute queue (``proofline/shards.py``).
ROLE_QUEUES = {"execute": "actions,verify,compensate", "recovery": "recovery,reconcile",
               "all": "actions,verify,compensate,recovery,reconcile"}


def role_queues(role: str, tenant_shards: int) -> str:
    """The queues a role consumes, with ``actions`` and ``verify`` expanded to all their shards."""
    from proofline.shards import SHARDED, sharded_queues

    names: list[str] = []
    for name in ROLE_QUEUES[role].split(","):
        names.extend(sharded_queues(name, tenant_shards) if name in SHARDED else [name])
    return ",".join(names)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--role", type=click.Choice(sorted(ROLE_QUEUES)), default="all", show_default=True,
              help="execute: no recovery key; recovery: holds it; all: both (refused in production)")
@click.option("--queues", default=None, help="override the role's queues")
@click.option("--concurrency", default=2)
@click.option("--metrics-port", type=int, default=None, envvar="PROOFLINE_METRICS_PORT",
              help="serve this worker's Prometheus metrics on this port")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, envvar="PROOFLINE_METRICS_HOST",
              help="address of the metrics endpoint")
@click.pass_context
def worker(ctx: click.Context, role: str, queues: str | None, concurrency: int, metrics_port: int | None,
           metrics_host: str) -> None:
    """Run a supervised Celery worker (prefork) for a role; extra options go to Celery.

    Its keys are checked before it starts (a production process refuses development keys, an
    execute worker that can read a private key, and the combined role). The worker is restarted if
    it dies (for example when the broker crashes under it)."""
    from proofline.errors import ConfigurationError
    from proofline.keys import check_process_keys
    from proofline.supervise import supervise

    try:
        for warning in check_process_keys(get_settings(), role):
            click.echo(f"proofline worker: warning: {warning}", err=True)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    if metrics_port is not None:
        from proofline.telemetry.serve import prepare_multiprocess_dir, serve_worker_metrics

        prepare_multiprocess_dir()  # before Celery starts: its pool processes inherit the directory
        serve_worker_metrics(metrics_port, metrics_host)
    argv = [sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "-Q",
            queues or role_queues(role, get_settings().tenant_shards),
            "-c", str(concurrency), "-P", "prefork", "--loglevel", "INFO", *ctx.args]
    sys.exit(supervise(argv))


@main.group()
def keys() -> None:
    """Key files: generate, rotate, revoke."""


@keys.command("generate")
@click.option("--dir", "directory", required=True, type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="replace existing key files")
@click.option("--development", is_flag=True, help="mark the keys as development keys (refused in production)")
def keys_generate(directory: Path, force: bool, development: bool) -> None:
    """Write controller.key, recovery.key, ledger.key, seal.key (0600) and keyring.json."""
    from proofline.errors import ConfigurationError
    from proofline.keys import generate

    try:
        for path in generate(directory, force=force, development=development):
            click.echo(f"wrote {path}")
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None


@keys.command("rotate")
@click.option("--dir", "directory", required=True, type=click.Path(path_type=Path))
@click.option("--role", type=click.Choice(["controller", "recovery", "ledger"]), default="controller")
@click.option("--overlap-seconds", default=7200.0, show_default=True,
              help="the old key still verifies for this long (longer than the longest deadline)")
def keys_rotate(directory: Path, role: str, overlap_seconds: float) -> None:
    """A new key signs from now on; the old one verifies until its not_after."""
    from datetime import timedelta

    from proofline.errors import ConfigurationError
    from proofline.keys import KeyRole, rotate

    try:
        old, new = rotate(directory, KeyRole(role), timedelta(seconds=overlap_seconds))
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{role} key {new} signs now; {old} verifies for {overlap_seconds:g} s more")


@keys.command("revoke")
@click.argument("key_id")
@click.option("--keyring", "keyring", required=True, type=click.Path(path_type=Path))
def keys_revoke(key_id: str, keyring: Path) -> None:
    """Mark a key revoked: every message it signed is refused from now on."""
    from proofline.errors import ConfigurationError
    from proofline.keys import revoke

    try:
        revoke(keyring, key_id)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"revoked {key_id}")


@main.command()
@click.option("--keep", is_flag=True, help="leave the embedded Postgres running afterwards")
def demo(keep: bool) -> None:
    """Run the demo end to end (embedded Postgres and broker unless PROOFLINE_DATABASE_URL is set)."""
    from proofline.demo import run_demo

    sys.exit(run_demo(keep=keep))


main.add_command(__import__("proofline.telemetry.commands", fromlist=["exporter"]).exporter)

if __name__ == "__main__":
    main()
