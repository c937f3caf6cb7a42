"""The garbage collector in worker processes.

A pool process holds a large, long-lived heap (Celery, the MCP SDK, pydantic models, compiled
contracts, open sessions). CPython's full collection walks every tracked object, so each one took
50-85 ms in a pool process: that pause lands on whichever action is running, and it was the
largest single cause of the publish -> verified tail. ``gc.freeze()`` moves what exists at that
moment to a permanent generation that collections skip. It is called in the Celery main process
before the pool forks (the children start frozen, and their pages stay shared with the parent),
again in each pool process once it has set itself up, and once more after its first task, when
the sessions, connections and caches that live as long as the process exist. Objects created
after that are collected as before; cyclic garbage among the frozen ones is never freed, which is
why only start-up state is frozen.
"""

from __future__ import annotations

import gc
from typing import Any

from celery import signals

_after_first_task = {"pending": True}


@signals.worker_init.connect
def _freeze_before_fork(**_: Any) -> None:
    gc.collect()
    gc.freeze()


@signals.worker_process_init.connect
def _freeze_child(**_: Any) -> None:
    _after_first_task["pending"] = True
    gc.freeze()


@signals.task_postrun.connect
def _freeze_after_first_task(**_: Any) -> None:
    if _after_first_task["pending"]:
        _after_first_task["pending"] = False
        gc.collect()
        gc.freeze()
