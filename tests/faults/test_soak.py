"""The chaos soak (``ops/soak.py``) in CI's short form: many concurrent actions of every kind while
workers are killed and frozen, the broker is killed (Redis, or one node of a three-node RabbitMQ
cluster), Postgres sessions are terminated and its server restarted, the network to the system of
record misbehaves, the writer lies or is slow, verification reads go down and the keys are rotated;
then, once healed and quiet, every invariant over the whole history must hold.

Sized by ``PROOFLINE_SOAK_ACTIONS`` (work items, default 500), ``PROOFLINE_SOAK_SECONDS`` (fault
window, default 120), ``PROOFLINE_SOAK_CLUSTER_ACTIONS`` and ``PROOFLINE_SOAK_CLUSTER_SECONDS`` for
the cluster's soak (300, 90) and ``PROOFLINE_SOAK_SEED`` (default 1). A failure names the seed to
replay with ``python -m ops.soak`` and the offending action ids.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ops.soak import SoakConfig, run_soak, summary
from ops.soak_check import INVARIANTS
from ops.soak_faults import BROKER_FAULTS
from proofline_kit.rabbitmq_server import available as rabbitmq_available

ACTIONS = int(os.environ.get("PROOFLINE_SOAK_ACTIONS", "500"))
SECONDS = float(os.environ.get("PROOFLINE_SOAK_SECONDS", "120"))
SEED = int(os.environ.get("PROOFLINE_SOAK_SEED", "1"))
#: The clustered broker's soak: smaller (three RabbitMQ nodes share the two cores with the rest).
CLUSTER_ACTIONS = int(os.environ.get("PROOFLINE_SOAK_CLUSTER_ACTIONS", "300"))
CLUSTER_SECONDS = float(os.environ.get("PROOFLINE_SOAK_CLUSTER_SECONDS", "90"))
MAX_WAIT = 240.0


def soak_keeps_every_invariant(tmp_path: Path, broker: str, actions: int, seconds: float) -> None:
    config = SoakConfig(actions=actions, seconds=seconds, seed=SEED, max_wait=MAX_WAIT, workdir=tmp_path / "soak",
                        json_path=tmp_path / "soak.json", progress=False, broker=broker)
    result = run_soak(config)
    print(summary(result))
    assert result.error is None, result.failure_text()
    # Faults really happened, of several kinds, and the workload really ran.
    injected = {k: n for k, n in result.faults_by_kind.items() if "not injected" not in k}
    assert sum(injected.values()) >= max(3, seconds / 10), result.faults_by_kind
    assert len(injected) >= min(8, max(1, int(seconds / 10))), result.faults_by_kind
    assert injected.get("key_rotation") == 1, result.faults_by_kind  # once, in the middle
    assert injected.get(BROKER_FAULTS[broker], 0) >= 1, result.faults_by_kind  # the broker (a node of it) lost
    assert not any(k in injected for k in set(BROKER_FAULTS.values()) - {BROKER_FAULTS[broker]})
    # At least one fault per 20 actions.
    assert sum(injected.values()) * 20 >= result.submitted_actions, (result.faults_by_kind, result.submitted_actions)
    assert result.submitted_actions >= actions, result.controller
    assert result.quiet["reached"], f"not quiet after {MAX_WAIT} s: {result.quiet['still_open']}\n" + \
        result.failure_text()
    offending = result.offending()
    for name in INVARIANTS:
        assert not offending.get(name), result.failure_text()
    assert result.ok, result.failure_text()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="the soak starts its own redis-server")
@pytest.mark.timeout(int(SECONDS + MAX_WAIT + 300))
def test_soak_under_faults_keeps_every_invariant(tmp_path: Path) -> None:
    soak_keeps_every_invariant(tmp_path, "redis", ACTIONS, SECONDS)


@pytest.mark.timeout(int(CLUSTER_SECONDS + MAX_WAIT + 420))
def test_soak_on_a_rabbitmq_cluster_that_loses_nodes_keeps_every_invariant(tmp_path: Path) -> None:
    """The same mix with a three-node RabbitMQ cluster for broker: a node (any of the three, the
    first of every client's list among them) SIGKILLed and brought back instead of Redis."""
    if not rabbitmq_available():
        pytest.fail("RabbitMQ's scripts are not installed: this soak starts a cluster of its own "
                    "(Debian package rabbitmq-server; .ci/run installs it)")
    soak_keeps_every_invariant(tmp_path, "rabbitmq-cluster", CLUSTER_ACTIONS, CLUSTER_SECONDS)
