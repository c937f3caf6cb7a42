"""Pruning on a schedule is off unless asked for, and then runs on the checkpoint queue."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from proofline.settings import ROOT

PROBE = ("import json, worker.celery_config as c; "
         "print(json.dumps([c.beat_schedule.get('proofline-prune'), c.task_routes['proofline.prune']]))")


def _schedule(**env: str) -> list:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**clean, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_pruning_is_not_scheduled_by_default():
    entry, route = _schedule()
    assert entry is None and route == {"queue": "checkpoint"}


def test_a_prune_interval_schedules_it_on_the_checkpoint_queue():
    entry, _ = _schedule(PROOFLINE_PRUNE_INTERVAL_SECONDS="3600")
    assert entry["task"] == "proofline.prune" and entry["schedule"] == 3600.0
    assert entry["options"]["queue"] == "checkpoint"
