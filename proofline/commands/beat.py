"""``proofline beat``: the reconciler's timer (Celery beat), supervised like ``proofline worker``.

Beat only sends the periodic tasks (the reconcile sweep, ledger checkpoints); a worker consuming the
``reconcile`` queue (``proofline worker --role recovery``, or ``--role all``) runs them. Without a
running beat, a message the broker lost is never re-driven. One beat per node is fine, and keeps the
reconciler going when a node is lost: however many beats send a sweep, it runs once per period
across the fleet (``recovery/sweep_gate.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from proofline.commands.base import foreground, refuse_json
from proofline.settings import get_settings


@foreground
@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--schedule", "schedule", type=click.Path(path_type=Path), default=None,
              help="beat's schedule file (default: PROOFLINE_STATE_DIR/beat-schedule)")
@click.pass_context
def beat(ctx: click.Context, schedule: Path | None) -> None:
    """Run Celery beat for the reconciler and checkpoints (restarted if it dies); extra options go to Celery."""
    from proofline.supervise import supervise

    refuse_json("beat")
    if schedule is None:
        state = Path(get_settings().state_dir)
        state.mkdir(parents=True, exist_ok=True)
        schedule = state / "beat-schedule"
    argv = [sys.executable, "-m", "celery", "-A", "worker.tasks", "beat", "--loglevel", "INFO", "-s", str(schedule),
            *ctx.args]
    sys.exit(supervise(argv))
