"""Network faults between the workers and an MCP server over streamable HTTP, through the runtime.

The stack is ``http-proxy``: worker -> TCP fault proxy -> witness relay -> system-of-record
writer (the read-only identity is reached directly). The witness sits behind the proxy, so what it
logs is what the server was really handed; the system of record's effects log says what it applied.

- a TCP reset once the request has been forwarded: the response is lost, the effect is not;
  the call is an unknown outcome that verification settles, with one effect;
- refused connections: nothing is sent, the delivery is retried with the same envelope, and the
  action runs once the server can be reached;
- a request held back in the network past the call's timeout, then dropped with its connection:
  the ledger records two calls, the server saw one, and one refund exists.
"""

from __future__ import annotations

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.errors import McpUnavailable
from proofline_kit.sor import store as sor
from tests.conftest import Stack, wait_for
from tests.helpers import failed_reads, new_account, refund_env, ticket_env

PROXIED = pytest.mark.parametrize("stack", ["http-proxy"], indirect=True)


def calls_recorded(stack: Stack, action_id: str) -> list[dict]:
    return [e["evidence"] for e in stack.timeline(action_id) if e["event"] == "tool_called"]


@PROXIED
def test_reset_after_the_request_loses_the_response_not_the_effect(stack: Stack) -> None:
    env = refund_env(stack, new_account(stack), timeout_seconds=8)
    resets = stack.proxy.stats()["resets_sent"]
    # The server holds its answer for three seconds, so the reset, armed once the witness has seen
    # the request, lands while the call is open (even when this process is slow to arm it).
    sor.set_fault(stack.sor_db, "issue_refund", "delay", remaining=1, delay_seconds=3.0)
    try:
        stack.publish(env)
        wait_for(lambda: stack.witness.count(key=env.idempotency_key) == 1, 30, what="the request at the server")
        stack.proxy.set_mode("reset", after_request=True)
        stack.wait_event(env.action_id, "tool_called")
    finally:
        stack.proxy.set_mode("pass")
        sor.clear_faults(stack.sor_db, "issue_refund")
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
    assert [c["outcome"] for c in calls_recorded(stack, env.action_id)] == [Outcome.unknown_outcome.value]
    assert stack.proxy.stats()["resets_sent"] > resets
    [call] = stack.witness.calls(key=env.idempotency_key)
    assert call.tool == "issue_refund" and call.arguments_sha256 == env.arguments_hash
    assert stack.effects(env.idempotency_key) == 1
    # The refund id the lost response carried is recovered from the system of record.
    assert (row.result or {}).get("recovered_by") == "verification"


@PROXIED
def test_refused_connections_send_nothing_and_the_same_envelope_runs_later(stack: Stack) -> None:
    env = ticket_env(stack)
    stack.proxy.set_mode("refuse", reset_open=True)
    try:
        stack.publish(env)
        wait_for(lambda: failed_reads(stack, env.action_id) >= 2, 40,
                 what="two deliveries that could not reach the server")
        assert "tool_called" not in stack.events(env.action_id)
        assert stack.witness.count(key=env.idempotency_key) == 0
        assert stack.effects(env.idempotency_key) == 0
    finally:
        stack.proxy.set_mode("pass")
    row = stack.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
    waits = [e["evidence"] for e in stack.timeline(env.action_id) if e["event"] == "precheck_unavailable"]
    assert {w["reason_code"] for w in waits} == {McpUnavailable.code}
    assert len(calls_recorded(stack, env.action_id)) == 1
    assert stack.witness.count(key=env.idempotency_key) == 1
    assert stack.effects(env.idempotency_key) == 1


@PROXIED
def test_request_held_past_its_timeout_never_reaches_the_server(stack: Stack) -> None:
    env = refund_env(stack, new_account(stack), timeout_seconds=1.5)
    start = stack.witness.mark()
    # The precondition read is slow at the server (3 s, inside the read's 5 s timeout); while it
    # runs, the network starts holding every request back, so the call that follows the read is
    # held before the server sees it.
    sor.set_fault(stack.sor_db, "get_account", "delay", remaining=1, delay_seconds=3.0)
    try:
        stack.publish(env)
        wait_for(lambda: stack.witness.count(tool="get_account", server="sor", since=start) >= 1, 30,
                 what="the precondition read at the server")
        stack.proxy.set_mode("delay", seconds=120, direction="request")
        stack.wait_event(env.action_id, "tool_called")
        assert stack.witness.count(key=env.idempotency_key) == 0  # timed out while held in the network
        stack.proxy.set_mode("reset")  # the held request dies with its connection
    finally:
        stack.proxy.set_mode("pass")
        sor.clear_faults(stack.sor_db, "get_account")
    row = stack.wait_settled(env.action_id, timeout=60)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
    outcomes = [c["outcome"] for c in calls_recorded(stack, env.action_id)]
    # The first call is an unknown outcome (sent, then timed out); verification proved it absent and
    # the same envelope, with the same key, was called again.
    assert outcomes == [Outcome.unknown_outcome.value, Outcome.completed_unverified.value]
    findings = [e["evidence"]["finding"] for e in stack.timeline(env.action_id) if e["event"] == "verification_finished"]
    assert findings[0] == "absent" and findings[-1] == "expected"
    assert stack.witness.count(key=env.idempotency_key) == 1
    assert stack.effects(env.idempotency_key) == 1
