"""The Celery node a worker process belongs to, so the ledger says which node did the work.

Celery names each worker node (``-n name@host``). The main process learns its name before it forks
its pool, and hands it down through the environment (``PROOFLINE_NODE_NAME``) and a fresh settings
object: the pool processes' settings then carry it in ``worker_id`` (``name@host:pid``), the actor
of their ledger events, leases and sweep runs. A name set explicitly by the operator is kept.
"""

from __future__ import annotations

import os
from typing import Any

from celery import signals

from proofline.settings import get_settings

VARIABLE = "PROOFLINE_NODE_NAME"


@signals.celeryd_init.connect
def _hand_down_node_name(sender: str | None = None, **_: Any) -> None:
    if sender and not get_settings().node_name:
        os.environ[VARIABLE] = sender
        get_settings.cache_clear()  # settings read before now (and inherited by the pool) lack the name
