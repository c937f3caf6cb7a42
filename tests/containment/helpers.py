"""Raw messages on the real broker, and what the supervised worker did meanwhile."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

from kombu import Connection

from tests.conftest import Stack, wait_for
from worker import wire


def push(stack: Stack, body: bytes | str, content_type: str = wire.CONTENT_TYPE, *, task: str = "proofline.execute",
         headers: dict[str, Any] | None = None, content_encoding: str = "utf-8", queue: str = "actions") -> str:
    """Put one raw message on a queue with kombu, as anyone with access to the broker could."""
    task_id = str(uuid.uuid4())
    hdrs = {"lang": "py", "task": task, "id": task_id, "root_id": task_id, "parent_id": None, "retries": 0,
            "argsrepr": "()", "kwargsrepr": "{}", "origin": "test"}
    hdrs.update(headers or {})
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    with Connection(stack.broker_url) as conn:
        conn.Producer().publish(body, exchange="", routing_key=queue, content_type=content_type,
                                content_encoding=content_encoding, headers=hdrs, serializer=None)
    return task_id


def deep_body(depth: int = 940) -> bytes:
    """A protocol 2 body whose single argument nests ``depth`` lists deep."""
    return b"[[" + b"[" * depth + b"]" * depth + b"],{},{}]"


def refusal_for(stack: Stack, task_id: str, event: str = "envelope_refused") -> dict[str, Any] | None:
    with stack.conn.cursor() as cur:
        cur.execute("SELECT action_id, evidence FROM ledger_events WHERE event = %s AND evidence->>'task_id' = %s "
                    "ORDER BY id DESC LIMIT 1", (event, task_id))
        row = cur.fetchone()
    return {**row["evidence"], "chain": row["action_id"]} if row else None


def wait_refusal(stack: Stack, task_id: str, timeout: float = 20.0) -> dict[str, Any]:
    return wait_for(lambda: refusal_for(stack, task_id), timeout, what=f"a refusal record for task {task_id}")


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def celery_main_pid(stack: Stack) -> int:
    """The Celery main process under the first supervised worker (``proofline worker``)."""
    found = children(stack.workers[0].pid)
    assert len(found) == 1, f"supervisor has children {found}"
    return found[0]


def worker_starts(stack: Stack, name: str = "w0") -> int:
    """How many times the supervisor started the Celery worker (it logs each start)."""
    log = (stack.workdir / f"worker-{name}.log").read_text(errors="replace")
    return len(re.findall(r"proofline: worker started", log))


def worker_log(stack: Stack, name: str = "w0") -> str:
    return (stack.workdir / f"worker-{name}.log").read_text(errors="replace")
