"""The chaos soak (``ops/soak.py``) in CI's short form: many concurrent actions of every kind while
workers are killed and frozen, Redis is killed, Postgres sessions are terminated and its server
restarted, the network to the system of record misbehaves, the writer lies or is slow,
verification reads go down and the keys are rotated; then, once healed and quiet, every
invariant over the whole history must hold.

Sized by ``PROOFLINE_SOAK_ACTIONS`` (work items, default 500), ``PROOFLINE_SOAK_SECONDS`` (fault
window, default 120) and ``PROOFLINE_SOAK_SEED`` (default 1). A failure names the seed to replay with
``python -m ops.soak`` and the offending action ids.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ops.soak import SoakConfig, run_soak, summary
from ops.soak_check import INVARIANTS

ACTIONS = int(os.environ.get("PROOFLINE_SOAK_ACTIONS", "500"))
SECONDS = float(os.environ.get("PROOFLINE_SOAK_SECONDS", "120"))
SEED = int(os.environ.get("PROOFLINE_SOAK_SEED", "1"))
MAX_WAIT = 240.0

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="the soak starts its own redis-server")


@pytest.mark.timeout(int(SECONDS + MAX_WAIT + 300))
def test_soak_under_faults_keeps_every_invariant(tmp_path: Path) -> None:
    config = SoakConfig(actions=ACTIONS, seconds=SECONDS, seed=SEED, max_wait=MAX_WAIT, workdir=tmp_path / "soak",
                        json_path=tmp_path / "soak.json", progress=False)
    result = run_soak(config)
    print(summary(result))
    assert result.error is None, result.failure_text()
    # Faults really happened, of several kinds, and the workload really ran.
    injected = {k: n for k, n in result.faults_by_kind.items() if "not injected" not in k}
    assert sum(injected.values()) >= max(3, SECONDS / 10), result.faults_by_kind
    assert len(injected) >= min(8, max(1, int(SECONDS / 10))), result.faults_by_kind
    assert injected.get("key_rotation") == 1, result.faults_by_kind  # once, in the middle
    # At least one fault per 20 actions.
    assert sum(injected.values()) * 20 >= result.submitted_actions, (result.faults_by_kind, result.submitted_actions)
    assert result.submitted_actions >= ACTIONS, result.controller
    assert result.quiet["reached"], f"not quiet after {MAX_WAIT} s: {result.quiet['still_open']}\n" + \
        result.failure_text()
    offending = result.offending()
    for name in INVARIANTS:
        assert not offending.get(name), result.failure_text()
    assert result.ok, result.failure_text()
