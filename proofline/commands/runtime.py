"""Running Proofline: ``worker``, ``demo``, ``soak`` (foreground processes) and ``keys``."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import click

from proofline.commands.base import MODE, emit, foreground, raw_options, refuse_json, settings

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


@foreground
@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--role", type=click.Choice(sorted(ROLE_QUEUES)), default="all", show_default=True,
              help="execute: no recovery key; recovery: holds it; all: both (refused in production)")
@click.option("--queues", default=None, help="override the role's queues")
@click.option("--concurrency", type=click.IntRange(min=1), default=None,
              help="prefork pool processes (default PROOFLINE_WORKER_CONCURRENCY: twice the processors)")
@click.option("--metrics-port", type=int, default=None, envvar="PROOFLINE_METRICS_PORT",
              help="serve this worker's Prometheus metrics on this port")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, envvar="PROOFLINE_METRICS_HOST",
              help="address of the metrics endpoint")
@click.pass_context
def worker(ctx: click.Context, role: str, queues: str | None, concurrency: int | None, metrics_port: int | None,
           metrics_host: str) -> None:
    """Run a supervised Celery worker (prefork) for a role; extra options go to Celery.

    Before it consumes it runs ``proofline doctor``'s checks of its setup (servers file, sandbox,
    contracts, pins, keys, database and migrations) and refuses to start on the first that fails:
    one line, exit 3 (a production process refuses development keys, the combined role, root, a
    private key of another role it can read, a broker that asks no credentials and a database role
    let in without a password). The worker is restarted if it dies (for example when the broker
    crashes under it)."""
    from proofline.keys import check_process_keys
    from proofline.setup_checks import refuse_bad_setup
    from proofline.supervise import supervise
    from worker import preload
    from worker.in_flight import HeldMessages

    refuse_json("worker")
    warnings = refuse_bad_setup(settings(), role)
    for warning in [*warnings, *check_process_keys(settings(), role)]:
        click.echo(f"proofline worker: warning: {warning}", err=True)
    if metrics_port is not None:
        from proofline.telemetry.serve import prepare_multiprocess_dir, serve_worker_metrics

        prepare_multiprocess_dir()  # before Celery starts: its pool processes inherit the directory
        serve_worker_metrics(metrics_port, metrics_host)
    argv = [sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "-Q",
            queues or role_queues(role, settings().tenant_shards),
            "-c", str(concurrency or settings().worker_concurrency), "-P", "prefork", "--loglevel", "INFO", *ctx.args]
    # What a run held when it was killed or stopped is excused, not counted against the messages.
    held = HeldMessages(settings())
    forking = metrics_port is None  # the metrics endpoint is a thread of this process: no fork then
    if forking:
        preload.modules(preload.LIBRARIES)  # each run is forked with them loaded (proofline/supervise.py)
    try:
        code = supervise(argv, hooks=held, fork_main=_celery_main if forking else None)
    finally:
        held.close()
    sys.exit(code)


def _celery_main() -> None:
    """A forked run's body: ``python -m celery`` with the run's argv (``celery ...`` after ``-m``)."""
    import celery.__main__

    sys.argv = [celery.__main__.__file__, *sys.argv[3:]]
    celery.__main__.main()


@click.command()
@click.option("--keep", is_flag=True, help="leave the embedded Postgres running afterwards (and say how to stop it)")
@click.option("--stop", is_flag=True, help="stop the embedded Postgres a `demo --keep` left running, and exit")
def demo(keep: bool, stop: bool) -> None:
    """Run the demo end to end (embedded Postgres and broker unless PROOFLINE_DATABASE_URL is set)."""
    from contextlib import redirect_stdout

    from proofline_kit.demo import run_demo, stop_demo  # the demo is part of the kit

    if stop:
        sys.exit(stop_demo())

    if not MODE.json:
        sys.exit(run_demo(keep=keep))
    rows: list[dict] = []
    with redirect_stdout(sys.stderr):  # the progress and the table go to stderr; stdout is the document
        code = run_demo(keep=keep, report=rows)
    emit({"actions": rows}, "")
    sys.exit(code)


@raw_options
@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def soak(ctx: click.Context) -> None:
    """The chaos soak with its history checker (options: see `python -m ops.soak --help`; its own
    `--json PATH` writes the full result)."""
    from proofline.settings import ROOT

    sys.path.insert(0, str(ROOT))  # ops/ and tests/ live in the checkout, not in the package
    from ops.soak import main as soak_main

    sys.exit(soak_main(list(ctx.args)))


@foreground
@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--address", default="127.0.0.1", show_default=True)
@click.option("--port", default=5555, show_default=True)
@click.pass_context
def flower(ctx: click.Context, address: str, port: int) -> None:
    """Run Flower with Proofline's configuration: each task's result starts with its action's
    outcome and id, and an escalated, contained, kill-switched, failed or not yet verified action's
    task ends in a state of that name, not SUCCESS (extra options go to Flower)."""
    import os

    import worker

    refuse_json("flower")
    conf = Path(worker.__file__).resolve().parent / "flower_config.py"
    argv = [sys.executable, "-m", "celery", "-A", "worker.tasks", "flower", f"--conf={conf}", f"--address={address}",
            f"--port={port}", *ctx.args]
    os.execv(sys.executable, argv)


@click.group()
def keys() -> None:
    """Key files: generate, rotate, revoke."""


@keys.command("generate")
@click.option("--dir", "directory", required=True, type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="replace existing key files")
@click.option("--development", is_flag=True, help="mark the keys as development keys (refused in production)")
def keys_generate(directory: Path, force: bool, development: bool) -> None:
    """Write controller.key, recovery.key, ledger.key, worker.key, seal.key, auditor.key (0600),
    keyring.json and auditor.pub."""
    from proofline.keys import generate

    written = [str(p) for p in generate(directory, force=force, development=development)]
    emit({"wrote": written}, "\n".join(f"wrote {p}" for p in written))


@keys.command("rotate")
@click.option("--dir", "directory", required=True, type=click.Path(path_type=Path))
@click.option("--role", type=click.Choice(["controller", "recovery", "ledger", "worker"]), default="controller")
@click.option("--overlap-seconds", default=7200.0, show_default=True,
              help="the old key still verifies for this long (longer than the longest deadline)")
def keys_rotate(directory: Path, role: str, overlap_seconds: float) -> None:
    """A new key signs from now on; the old one verifies until its not_after."""
    from proofline.keys import KeyRole, rotate

    old, new = rotate(directory, KeyRole(role), timedelta(seconds=overlap_seconds))
    emit({"role": role, "new_key": new, "old_key": old, "overlap_seconds": overlap_seconds},
         f"{role} key {new} signs now; {old} verifies for {overlap_seconds:g} s more")


@keys.command("add-approver")
@click.option("--identity", required=True, help="who approves with this key (a person or an approval service)")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="the private key file (0600)")
@click.option("--keyring", "keyring", required=True, type=click.Path(path_type=Path))
@click.option("--development", is_flag=True, help="mark the key as a development key (refused in production)")
def keys_add_approver(identity: str, out: Path, keyring: Path, development: bool) -> None:
    """Make an approver key: its private file for that approver alone, its public entry (naming the
    identity) in the keyring. Approver keys sign approvals and authority policies, nothing else."""
    from proofline.keys import add_approver

    key_id = add_approver(keyring, out, identity, development)
    emit({"key_id": key_id, "identity": identity, "wrote": str(out)},
         f"approver key {key_id} for {identity}: {out} (keep it with the approver), public part in {keyring}")


@keys.command("add-worker")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="the private key file (0600)")
@click.option("--keyring", "keyring", required=True, type=click.Path(path_type=Path))
@click.option("--development", is_flag=True, help="mark the key as a development key (refused in production)")
def keys_add_worker(out: Path, keyring: Path, development: bool) -> None:
    """One more worker key (another worker host or process): its private file for that worker alone,
    its public entry in the keyring. Worker keys sign evidence, nothing else."""
    from proofline.keys import add_worker

    key_id = add_worker(keyring, out, development)
    emit({"key_id": key_id, "wrote": str(out)},
         f"worker key {key_id}: {out} (point that worker's PROOFLINE_WORKER_KEY_FILE at it), public part in {keyring}")


@keys.command("add-auditor")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path),
              help="the auditor's private key file (0600; for the auditor alone)")
@click.option("--public", "public", required=True, type=click.Path(path_type=Path),
              help="the public key file (0644; every worker reads it: PROOFLINE_AUDITOR_PUBLIC_KEY_FILE)")
@click.option("--development", is_flag=True, help="mark the key as a development key (refused in production)")
def keys_add_auditor(out: Path, public: Path, development: bool) -> None:
    """Make the auditor's X25519 key pair: workers seal captured evidence to the public half; only the
    private half (never on a worker host) opens it. An existing private key is never overwritten."""
    from proofline.auditor_keys import write_pair

    key_id = write_pair(out, public, development=development)
    emit({"key_id": key_id, "wrote": [str(out), str(public)]},
         f"auditor key {key_id}: {out} (the auditor's alone), public half {public} (for the workers)")


@keys.command("revoke")
@click.argument("key_id")
@click.option("--keyring", "keyring", required=True, type=click.Path(path_type=Path))
def keys_revoke(key_id: str, keyring: Path) -> None:
    """Mark a key revoked: every message it signed is refused from now on."""
    from proofline.keys import revoke

    revoke(keyring, key_id)
    emit({"revoked": key_id}, f"revoked {key_id}")


COMMANDS = (worker, demo, soak, flower, keys)
