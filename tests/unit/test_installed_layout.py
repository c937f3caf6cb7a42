"""The installed product does not depend on the current directory: the Celery app finds its
configuration from anywhere (regression: ``No module named 'celeryconfig'`` outside the checkout)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _outside(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PROOFLINE_")}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)


def test_the_celery_app_loads_its_configuration_outside_the_checkout(tmp_path: Path) -> None:
    done = _outside(tmp_path, "from worker.tasks import app\n"
                              "c = app.conf\n"
                              "print(c.task_serializer, c.worker_consumer, c.task_routes['proofline.recover']['queue'],"
                              " c.task_acks_late, c.worker_prefetch_multiplier)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["proofline", "worker.guard:GuardedConsumer", "recovery", "True", "1"]


def test_the_checkout_name_still_serves_the_same_configuration(tmp_path: Path) -> None:
    import celeryconfig
    from worker import celery_config

    assert celeryconfig.task_routes == celery_config.task_routes
    assert celeryconfig.accept_content == celery_config.accept_content
