"""Not collected by itself: run by test_kit_processes.py in a pytest of its own. Builds a stack,
starts a worker (with beat) and makes it spawn its audited stdio server, says so in the file named
by HELD_STACK_READY, then waits to be stopped."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from tests.conftest import build_stack, start_workers


def test_hold_a_stack(tmp_path: Path) -> None:
    s = build_stack("stdio", tmp_path)
    start_workers(s, concurrency=1)
    ticket = s.envelope("ticket.create", target={"type": "ticket_queue", "id": "acme-ops"},
                        arguments={"tenant": "acme", "title": "held", "owner": "alice"})
    s.publish(ticket)
    s.wait_settled(ticket.action_id)  # the worker's pool process has its sandboxed, audited server now
    Path(os.environ["HELD_STACK_READY"]).write_text(str(os.getpid()))
    threading.Event().wait(600)  # the parent test stops this run long before
