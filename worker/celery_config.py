"""Celery configuration, read from the one typed settings object (``proofline.settings``).

Choices that matter for correctness:
- late acknowledgement and requeue when a worker process is lost: a message is only gone once its
  task has recorded what happened in the ledger;
- prefetch 1: a worker never sits on messages another worker could run;
- the Proofline wire format only (``worker/wire.py``: JSON with size and depth bounds, checked
  before Celery sees the body); anything else is refused and recorded by the guarded consumer
  (``worker/guard.py``), never silently dropped;
- time limits and pool-process recycling from Settings, so no task and no leak lives forever;
- on Redis, a visibility timeout longer than the longest absolute deadline, so Redis does not hand
  a running task to a second worker; on RabbitMQ, quorum queues, publisher confirms and a delivery
  limit with a dead-letter exchange (``worker/broker.py``); deadlines live in Postgres, never in
  broker ETAs;
- results are not stored: the ledger is the record.
"""

from proofline.settings import get_settings, reveal
from worker import broker as _broker

_settings = get_settings()

broker_url = reveal(_settings.broker_url)
broker_connection_retry_on_startup = True
# Transport options, and on RabbitMQ the quorum queues, confirms and delivery limit (worker/broker.py).
globals().update(_broker.celery_options(_settings, broker_url))
if broker_url.startswith("redis://"):
    # Documents kombu cannot parse become recorded refusals instead of ending the consumer.
    from worker.transport import install as _guard_transport

    _guard_transport()

import worker.wire as _wire  # noqa: E402 - registers the serializer before Celery reads the names below

task_serializer = _wire.NAME
accept_content = [_wire.CONTENT_TYPE]
result_accept_content = ["json"]
worker_consumer = "worker.guard:GuardedConsumer"
result_serializer = "json"
event_serializer = "json"
task_ignore_result = True
result_backend = None

# No task may outlive the longest deadline an envelope can carry: the soft limit raises inside the
# task (a call in flight is then an unknown outcome, reconciled), the hard one ends the process.
task_soft_time_limit = _settings.max_deadline_seconds + 60
task_time_limit = _settings.max_deadline_seconds + 120
worker_max_tasks_per_child = _settings.worker_max_tasks_per_child
worker_max_memory_per_child = _settings.worker_max_memory_per_child_kb

task_acks_late = True
task_reject_on_worker_lost = True
# A task that raised or timed out is acknowledged: its outcome is in the ledger (Celery 5.7 splits
# the older task_acks_on_failure_or_timeout in two)
task_acks_on_failure = True
task_acks_on_timeout = True
worker_prefetch_multiplier = 1
# When the broker connection drops (a broker restart), a task mid-call goes on and records its
# result; its message, which can no longer be acknowledged, comes back and is suppressed by the
# idempotency claim. Cancelling it (Celery 6's announced default) would make every broker blip an
# unknown outcome to reconcile.
worker_cancel_long_running_tasks_on_connection_loss = False
# Task events cost ~2 ms of worker CPU per task; Flower switches them on when it connects.
worker_send_task_events = _settings.task_events
task_send_sent_event = _settings.task_events

task_default_queue = "actions"
task_routes = _broker.task_routes(_settings, broker_url, {
    "proofline.execute": {"queue": "actions"},
    "proofline.verify": {"queue": "verify"},
    "proofline.recheck": {"queue": "verify"},
    "proofline.read": {"queue": "verify"},
    "proofline.compensate": {"queue": "compensate"},
    # Deciding and signing recovery envelopes: only processes holding the recovery key consume it.
    "proofline.recover": {"queue": "recovery"},
    "proofline.reconcile": {"queue": "reconcile"},
    "proofline.checkpoint": {"queue": "checkpoint"},
    "proofline.prune": {"queue": "checkpoint"},
})
imports = ("worker.tasks",)

# The reconciler re-drives work from the ledger; beat only triggers it. Any number of beats may send
# it: the sweep runs once per period across the fleet (recovery/sweep_gate.py).
beat_schedule = {
    "proofline-reconcile": {
        "task": "proofline.reconcile",
        "schedule": _settings.reconcile_interval_seconds,
        "options": {"queue": "reconcile", "expires": _settings.reconcile_interval_seconds},
    },
    # Signed ledger checkpoints (ledger/checkpoint.py): consumed only by processes that hold the
    # ledger key (``proofline worker --queues checkpoint``); unconsumed ones expire.
    "proofline-checkpoint": {
        "task": "proofline.checkpoint",
        "schedule": _settings.checkpoint_interval_seconds,
        "options": {"queue": "checkpoint", "expires": _settings.checkpoint_interval_seconds},
    },
}
# Retention pruning (ledger/retention.py), off unless ``prune_interval_seconds`` is set: it runs on
# the checkpoint queue (it needs the keyring and the checkpoint store) as the pruning role.
if _settings.prune_interval_seconds > 0:
    beat_schedule["proofline-prune"] = {
        "task": "proofline.prune",
        "schedule": _settings.prune_interval_seconds,
        "options": {"queue": "checkpoint", "expires": _settings.prune_interval_seconds},
    }
