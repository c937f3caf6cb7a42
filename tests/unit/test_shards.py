"""Tenant shards of the execute queue: stable placement, publishing side and worker side agree."""

from __future__ import annotations

import hashlib
from typing import Any

from proofline.cli import role_queues
from proofline.shards import execute_queues, queue_for_tenant, shard_of
from worker.dispatch import CeleryDispatch


class Recorder:
    """Stands in for the Celery app's ``send_task``: records where each message was sent."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send_task(self, name: str, **options: Any) -> Any:
        self.sent.append({"name": name, **options})
        return type("Result", (), {"id": "t-1"})()


def test_shard_is_sha256_of_the_tenant_mod_n() -> None:
    digest = hashlib.sha256(b"globex").digest()
    assert shard_of("globex", 8) == int.from_bytes(digest[:8], "big") % 8
    assert shard_of("globex", 1) == 0
    spread = {shard_of(f"tenant-{i}", 8) for i in range(200)}
    assert spread == set(range(8))


def test_worker_roles_consume_every_shard() -> None:
    assert execute_queues(3) == ["actions", "actions.1", "actions.2"]
    assert role_queues("execute", 3) == "actions,actions.1,actions.2,verify,verify.1,verify.2,compensate"
    assert role_queues("all", 2).split(",")[:2] == ["actions", "actions.1"]
    assert role_queues("recovery", 8) == "recovery,reconcile"


def test_dispatch_routes_execute_by_tenant_and_keeps_compensate() -> None:
    app = Recorder()
    dispatch = CeleryDispatch(app, tenant_shards=8)
    message = {"envelope": {"action_id": "a-1", "tenant": "noisy"}}
    dispatch.execute(message)
    dispatch.execute(message, queue="actions")
    dispatch.execute(message, queue="compensate")
    dispatch.execute({"envelope": "not a dict"})
    queues = [s["queue"] for s in app.sent]
    assert queues == [queue_for_tenant("noisy", 8)] * 2 + ["compensate", "actions"]
    assert queues[0] != "actions"
    assert [s["name"] for s in app.sent] == ["proofline.execute"] * 2 + ["proofline.compensate", "proofline.execute"]


def test_verification_goes_to_the_tenants_verify_shard() -> None:
    app = Recorder()
    dispatch = CeleryDispatch(app, tenant_shards=8)
    dispatch.verify("a-1", "noisy")
    dispatch.verify("a-2")
    shard = shard_of("noisy", 8)
    assert [s["queue"] for s in app.sent] == ["verify" if shard == 0 else f"verify.{shard}", "verify"]
    assert {s["name"] for s in app.sent} == {"proofline.verify"}
