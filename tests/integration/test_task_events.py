"""Task events (what Flower shows) reach a monitor even when publishing one failed.

Celery keeps a task event whose publish raised in its dispatcher's buffer and tries it again only
when the worker sends its next task event. A worker whose last task before a quiet spell met a
broker error would never show that task's end in Flower. Here the worker's Redis user loses
``PUBLISH`` (Redis ACLs apply to connections already open) while one action runs, gets it back,
and no other task runs after it: the action's events must still arrive.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from proofline_kit.processes import wait_for
from proofline_kit.resources import redis_url
from proofline_kit.stack import Stack, build_stack, start_workers, teardown_stack
from tests.containment.helpers import worker_log
from tests.helpers import ticket_env
from tests.integration.event_monitor import EventMonitor


def _with_user(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{user}:{password}@{host}", parts.path, parts.query, parts.fragment))


@pytest.fixture
def events_stack(tmp_path: Path) -> Iterator[tuple[Stack, redis.Redis, str]]:
    """A stack whose workers reach Redis as a user of their own, with task events on."""
    base = redis_url()
    admin = redis.Redis.from_url(base)
    user, password = f"pl-events-{secrets.token_hex(4)}", secrets.token_hex(12)
    admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all")
    stack = None
    try:
        stack = build_stack("stdio", tmp_path, redis_url=_with_user(base, user, password),
                            extra_env={"PROOFLINE_TASK_EVENTS": "true", "PROOFLINE_REDRIVE_AFTER_SECONDS": "600"})
        start_workers(stack)
        yield stack, admin, user
    finally:
        if stack is not None:
            teardown_stack(stack)
        admin.execute_command("ACL", "DELUSER", user)


def test_a_task_event_whose_publish_failed_reaches_the_monitor_without_another_task(
        events_stack: tuple[Stack, redis.Redis, str]) -> None:
    stack, admin, user = events_stack
    monitor = EventMonitor(stack.broker_url)
    try:
        # Events flow: the first action's end is seen.
        first = ticket_env(stack)
        stack.publish(first)
        stack.wait_settled(first.action_id)
        wait_for(lambda: monitor.ended(first.action_id), 60, what=lambda: f"the first action's end; saw {monitor.events[-5:]}")

        admin.execute_command("ACL", "SETUSER", user, "-publish")
        try:
            second = ticket_env(stack)
            stack.publish(second)
            stack.wait_settled(second.action_id)
            # The task has returned; its end event follows from the worker's main process as soon
            # as the pool hands back the result (milliseconds), and its publish is refused.
            wait_for(lambda: any("succeeded in" in line and f"action={second.action_id}" in line
                                 for line in worker_log(stack).splitlines()),
                     60, what="the worker's line for the second action's task")
            time.sleep(2)
            assert any(d["command"] == "publish" for d in _acl_denials(admin, user)), _acl_denials(admin, user)
            assert monitor.ended(second.action_id) == []
        finally:
            admin.execute_command("ACL", "SETUSER", user, "+publish")
        # No other task runs now; the held event must still arrive.
        wait_for(lambda: monitor.ended(second.action_id), 30,
                 what=lambda: f"the second action's end after PUBLISH came back; saw {monitor.events[-5:]}")
    finally:
        monitor.stop()


def _acl_denials(admin: redis.Redis, user: str) -> list[dict[str, Any]]:
    entries = admin.execute_command("ACL", "LOG")
    found = []
    for entry in entries:
        fields = dict(zip(entry[::2], entry[1::2], strict=False)) if isinstance(entry, list) else dict(entry)
        fields = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                  for k, v in fields.items()}
        if fields.get("username") == user:
            found.append({"command": fields.get("object"), "reason": fields.get("reason")})
    return found
