"""The system of record's MCP Tasks (``SOR_CONTRACT_VARIANT=tasks``, proofline_kit/sor/tasks.py) as a
real stdio subprocess, driven by the worker's own task requests (worker/mcp_tasks.py): what it
advertises, a task created, polled and retrieved, the errors the spec gives for a plain call of a
task-only tool, an unknown task and a cancel of a finished one, and a cancel before the job ran."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError

from proofline.contracts import McpTask
from proofline_kit.sor import store
from proofline_kit.sor.server import IDEMPOTENCY_META_KEY
from worker import mcp_tasks
from worker.mcp_tasks import TaskLog

REPO = Path(__file__).resolve().parents[2]


def writer(db: Path) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=["-m", "proofline_kit.sor", "--transport", "stdio"],
                                 env={"SOR_DB": str(db), "PYTHONPATH": str(REPO), "SOR_ROLE": "writer",
                                      "SOR_CONTRACT_VARIANT": "tasks"}, cwd=str(REPO))


def test_the_tasks_variant_serves_a_task_from_creation_to_result(tmp_path: Path) -> None:
    db = tmp_path / "sor.sqlite3"
    store.seed_demo(db)
    ticket = store.put_ticket(db, "acme", "close as a task", "ops")
    other = store.put_ticket(db, "acme", "cancel before it runs", "ops")
    store.set_fault(db, "close_ticket_task", "delay", remaining=1, delay_seconds=0.2)

    async def main() -> None:
        async with Client(writer(db)) as client:
            capabilities = client.session.server_capabilities.model_dump(by_alias=True, exclude_none=True)
            assert mcp_tasks.advertised(capabilities)
            with pytest.raises(MCPError) as plain:
                await client.call_tool("close_ticket_task", {"ticket_id": ticket, "expected_version": 1})
            assert plain.value.code == -32601  # taskSupport: required
            created = await mcp_tasks._send_call(client, "close_ticket_task", {"ticket_id": ticket, "expected_version": 1},
                                                 {IDEMPOTENCY_META_KEY: "k-task"}, 10_000, 5)
            task_id = created.task.task_id
            assert (created.task.status, created.task.ttl) == ("working", 10_000)
            log = TaskLog(limit=5)
            status = await mcp_tasks._poll(client, task_id, McpTask(), log, 5, time.monotonic() + 30, None)
            assert status == "completed" and log.statuses[0]["status"] == "working"
            result = await mcp_tasks._result(client, task_id, 5)
            assert result.structured_content == {"ticket_id": ticket, "status": "closed", "version": 2}
            with pytest.raises(MCPError) as finished:
                await mcp_tasks._cancel(client, task_id)
            assert finished.value.code == -32602
            with pytest.raises(mcp_tasks.McpTaskExpired):
                await mcp_tasks._poll(client, "task-unknown", McpTask(), TaskLog(limit=5), 5,
                                      time.monotonic() + 30, None)
            store.set_fault(db, "close_ticket_task", "delay", remaining=1, delay_seconds=30)
            slow = await mcp_tasks._send_call(client, "close_ticket_task", {"ticket_id": other, "expected_version": 1},
                                              {IDEMPOTENCY_META_KEY: "k-cancel"}, 10_000, 5)
            assert await mcp_tasks._cancel(client, slow.task.task_id) == "cancelled"

    anyio.run(main)
    assert store.count_effects(db, "k-task") == 1
    assert store.count_effects(db, "k-cancel") == 0
    assert store.get_ticket(db, other)["ticket"]["status"] == "open"
