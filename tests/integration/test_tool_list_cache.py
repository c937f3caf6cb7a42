"""The worker's tool-list cache (worker/tool_list.py), counted on the wire by the witness.

A warm session checks the approved tool contract against the list it already has: three MCP
requests per action (precondition read, write, verification read). The list is listed again when
the server says it changed, and a server restarted with a changed schema is still caught: its
next action is refused with ``tool_contract_changed`` before any call.

One worker with one pool process, so "the session" is one session per identity.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from ledger.states import Outcome
from proofline.envelope import Envelope
from proofline_kit.processes import gone
from proofline_kit.sor import store as sor
from tests.conftest import Stack, build_stack, start_workers, stop_process, teardown_stack, wait_for
from tests.helpers import sor_processes, ticket_env


@pytest.fixture(scope="module", params=["stdio", "http"])
def one_process(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = build_stack(request.param, tmp_path_factory.mktemp(f"tool-list-{request.param}"))
    try:
        start_workers(s, concurrency=1)
        yield s
    finally:
        teardown_stack(s)


def run_one(stack: Stack, env: Envelope | None = None) -> str:
    env = env or ticket_env(stack)
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert row.outcome == Outcome.completed_verified, (row.outcome, row.reason_code)
    return env.action_id


def requests_since(stack: Stack, mark: int) -> tuple[int, int]:
    """(every MCP request any server received, of which ``tools/list``) since ``mark``."""
    calls = stack.witness.count(since=mark)
    others = stack.witness.requests(since=mark)
    return calls + len(others), sum(1 for r in others if r["method"] == "tools/list")


def restart_workers(stack: Stack, **env: str) -> None:
    for proc in list(stack.workers):
        stop_process(proc)
        stack.workers.remove(proc)
    start_workers(stack, concurrency=1, env={**stack.env, **env})


def test_a_warm_cache_makes_three_requests_per_action(one_process: Stack) -> None:
    stack = one_process
    run_one(stack)  # opens the sessions and fills the cache
    mark = stack.witness.mark()
    for _ in range(3):
        run_one(stack)
    assert requests_since(stack, mark) == (9, 0)
    # With the maximum age at 0 every action lists the tools again: four requests each.
    restart_workers(stack, PROOFLINE_TOOL_LIST_MAX_AGE_SECONDS="0")
    try:
        run_one(stack)
        mark = stack.witness.mark()
        for _ in range(2):
            run_one(stack)
        assert requests_since(stack, mark) == (8, 2)
    finally:
        restart_workers(stack)


def test_list_changed_makes_the_next_action_list_again(one_process: Stack) -> None:
    stack = one_process
    run_one(stack)
    sor.set_fault(stack.sor_db, "create_ticket", "list_changed", remaining=1)
    run_one(stack)  # its write sends notifications/tools/list_changed on the request's stream
    mark = stack.witness.mark()
    run_one(stack)
    assert requests_since(stack, mark) == (4, 1)
    mark = stack.witness.mark()
    run_one(stack)
    assert requests_since(stack, mark) == (3, 0)


def restart_writer(stack: Stack, variant: int | None) -> None:
    """Restart the writer with tool-contract ``variant``: the HTTP server by the stack, the stdio
    server (which the worker spawns) by ending it; the worker starts it again when next needed."""
    if stack.transport == "http":
        stack.restart_writer(**({"SOR_CONTRACT_VARIANT": str(variant)} if variant else {}))
        return
    sor.set_contract_variant(stack.sor_db, variant)
    servers = sor_processes(stack, role="writer")
    assert servers, "the worker should hold a stdio writer session"
    for proc in servers:
        proc.send_signal(signal.SIGTERM)  # not a sandbox limit's signal: no violation recorded
    wait_for(lambda: all(gone(p) for p in servers), 10, what="the writer to exit")



def test_a_server_restarted_with_a_changed_schema_is_caught(one_process: Stack) -> None:
    stack = one_process
    run_one(stack)
    mark = stack.witness.mark()
    run_one(stack)
    assert requests_since(stack, mark)[1] == 0, "the cache should be warm"
    env = ticket_env(stack)  # approved against the schema the server has now
    restart_writer(stack, 2)
    try:
        stack.publish(env)
        row = stack.wait_settled(env.action_id)
        assert (row.outcome, row.reason_code) == (Outcome.not_started, "tool_contract_changed")
        assert stack.witness.count(action=env.action_id) == 0
        assert stack.effects(env.idempotency_key) == 0
    finally:
        restart_writer(stack, None)
    # The approved schema is back: the next action lists again (on a new stdio session, which also
    # makes its discovery request) and runs with its three calls.
    again = ticket_env(stack)  # the controller lists the tools to approve it (counted before the mark)
    mark = stack.witness.mark()
    run_one(stack, again)
    assert requests_since(stack, mark)[1] == 1
    assert stack.witness.count(since=mark) == 3
