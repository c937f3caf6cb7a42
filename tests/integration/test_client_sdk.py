"""The controller SDK against a running stack: ``handle.wait`` returns each outcome class,
``publish_many`` writes a batch in one transaction, publishing starts no MCP server, tool contract
hashes come from the pinned registry (``proofline contracts pin``) and the worker still refuses a
pin the live server no longer matches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from pydantic import SecretStr

from ledger.states import ActionStatus, Outcome
from proofline import Client
from proofline.errors import ArgumentsInvalid, BrokerUnavailable, MalformedEnvelope, UnknownTool, WaitTimedOut
from proofline.settings import ROOT
from proofline_kit import zygote
from proofline_kit.sor import store as sor
from recovery.cancel import cancel
from tests.conftest import Stack, free_port, wait_for
from worker.dispatch import CeleryDispatch


def pin(stack: Stack, pins: Path, *extra: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``proofline contracts pin`` as an operator runs it, with the stack's configuration."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "SOR_"))}
    full.update({k: v for k, v in stack.env.items() if k.startswith(("PROOFLINE_", "SOR_"))})
    full.update({"PYTHONPATH": str(ROOT), "PROOFLINE_PINS_FILE": str(pins), **env})
    return zygote.run([sys.executable, "-m", "proofline", "contracts", *extra], env=full, cwd=pins.parent,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def pins(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pins") / "pins.json"
    done = pin(stack, path, "pin", "--by", "test-review")
    assert done.returncode == 0, done.stderr
    return path


@pytest.fixture()
def client(stack: Stack, pins: Path):
    with Client(stack.settings.model_copy(update={"pins_file": pins}), app=stack.app,
                database_url=stack.urls["controller"]) as c:
        yield c


def ticket(client: Client, **kw):
    return client.publish("ticket.create", tenant="acme", target={"type": "ticket_queue", "id": "acme-ops"},
                          arguments={"tenant": "acme", "title": f"sdk-{uuid.uuid4().hex[:8]}", "owner": "ops"}, **kw)


def refund(client: Client, stack: Stack, **kw):
    account = f"acct-{uuid.uuid4().hex[:10]}"
    sor.put_account(stack.sor_db, account, "acme", 100_000)
    version = sor.get_account(stack.sor_db, account)["account"]["version"]
    return client.publish("refund.issue", tenant="acme",
                          arguments={"account": account, "tenant": "acme", "amount_cents": 1200, "reason": "sla"},
                          target={"type": "account", "id": account, "expected_version": version}, **kw)


def test_wait_returns_verified(stack: Stack, client: Client) -> None:
    handle = ticket(client)
    result = handle.wait(timeout=60)
    assert result.verified and (result.status, result.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    assert result == handle.status()  # settled: wait and a plain read agree
    assert stack.effects(stack.action(handle.action_id).idempotency_key) == 1


def test_wait_returns_not_started_with_its_reason(stack: Stack, client: Client) -> None:
    ticket_id = sor.put_ticket(stack.sor_db, "acme", "to close", "ops")
    version = sor.get_ticket(stack.sor_db, ticket_id)["ticket"]["version"]
    envelope = client.prepare("ticket.close", tenant="acme", arguments={"ticket_id": ticket_id, "expected_version": version},
                              target={"type": "ticket", "id": ticket_id, "expected_version": version})
    sor.bump_version(stack.sor_db, "ticket", ticket_id)  # changed after approval
    result = client.publish(envelope).wait(timeout=60)
    assert (result.status, result.outcome, result.reason_code) == (ActionStatus.closed, Outcome.not_started,
                                                                    "stale_version")
    assert not result.verified


def test_wait_returns_escalated_unknown(stack: Stack, client: Client) -> None:
    sor.set_read_outage(stack.sor_db, True, role="reader")  # the verification read path is down
    try:
        handle = refund(client, stack)
        result = handle.wait(timeout=90)
    finally:
        sor.set_read_outage(stack.sor_db, False, role="reader")
    assert (result.status, result.outcome, result.finding) == (ActionStatus.escalated, Outcome.completed_unverified,
                                                               "unavailable")


def test_wait_returns_compensated(stack: Stack, client: Client) -> None:
    # The server applies the refund and keeps the call open; the cancellation reconciles and
    # compensates, and the action closes as compensated.
    sor.set_fault(stack.sor_db, "issue_refund", "drop_response", remaining=1, delay_seconds=3)
    handle = refund(client, stack, cancellation="reconcile_then_compensate")
    key = stack.action(handle.action_id).idempotency_key
    wait_for(lambda: stack.effects(key) == 1, 30, what="the refund to be applied")
    cancel(stack.operator, CeleryDispatch(stack.app), handle.action_id, "ops@example.com", "wrong customer")
    result = handle.wait(timeout=90)
    assert (result.status, result.outcome) == (ActionStatus.cancelled, Outcome.compensated)


def test_wait_times_out_while_the_action_runs_on(stack: Stack, client: Client) -> None:
    sor.set_fault(stack.sor_db, "create_ticket", "delay", remaining=1, delay_seconds=3)
    handle = ticket(client)
    with pytest.raises(WaitTimedOut) as raised:
        handle.wait(timeout=0.5)
    assert raised.value.code == "wait_timed_out"
    assert handle.wait(timeout=60).verified  # it was still running, not lost


def test_publish_many_records_the_batch_in_one_transaction(stack: Stack, client: Client) -> None:
    def published_xids(ids: list[str]) -> set[int]:
        # ledger_events rows are insert-only, so each keeps the id of the transaction that wrote it.
        with stack.conn.cursor() as cur:
            cur.execute("SELECT DISTINCT xmin::text::bigint AS xid FROM ledger_events "
                        "WHERE action_id = ANY(%s) AND event = 'published'", (ids,))
            return {r["xid"] for r in cur.fetchall()}

    batch = [{"action_type": "ticket.create", "tenant": "acme", "target": {"type": "ticket_queue", "id": "acme-ops"},
              "arguments": {"tenant": "acme", "title": f"batch-{i}-{uuid.uuid4().hex[:6]}", "owner": "ops"}}
             for i in range(6)]
    handles = client.publish_many(batch)
    assert len(published_xids([h.action_id for h in handles])) == 1
    assert all(h.wait(timeout=90).verified for h in handles)
    # The same envelopes one by one: one transaction each (the measure can tell them apart).
    singles = [ticket(client) for _ in range(3)]
    assert len(published_xids([h.action_id for h in singles])) == 3
    for h in singles:
        h.wait(timeout=60)


def test_publish_starts_no_server(stack: Stack, client: Client, tmp_path: Path) -> None:
    # The client's servers file names a "server" that leaves a mark whenever anything starts it.
    mark = tmp_path / "started"
    trap = tmp_path / "servers.yaml"
    trap.write_text(yaml.safe_dump({"servers": {"sor": {
        "transport": "stdio", "command": ["/bin/sh", "-c", f"echo started >> {mark}"],
        "sandbox": {"enabled": False}, "read_identity": {}}}}))
    trapped = client.settings.model_copy(update={"servers_file": trap})
    with Client(trapped, app=stack.app, database_url=stack.urls["controller"]) as c:
        result = ticket(c).wait(timeout=60)
    assert result.verified and not mark.exists()
    # The trap does fire when a server is started: the old per-publish probe would have left the mark.
    from proofline.controller import describe_server

    with pytest.raises(BaseException):  # noqa: B017 - it is not an MCP server; only the mark matters here
        describe_server(trapped, "sor")
    assert mark.exists()


def test_pinned_hash_the_live_server_no_longer_matches_is_refused(stack: Stack, tmp_path: Path) -> None:
    # Reviewed and pinned while the server described create_ticket differently (variant 3 rewords it).
    pins = tmp_path / "pins.json"
    done = pin(stack, pins, "pin", SOR_CONTRACT_VARIANT="3")
    assert done.returncode == 0, done.stderr
    check = pin(stack, pins, "pin", "--check")  # what an operator runs: the live server differs
    assert check.returncode == 1 and "changed  sor/create_ticket" in check.stderr
    with Client(stack.settings.model_copy(update={"pins_file": pins}), app=stack.app,
                database_url=stack.urls["controller"]) as c:
        handle = ticket(c)
        result = handle.wait(timeout=60)
    assert (result.outcome, result.reason_code) == (Outcome.not_started, "tool_contract_changed")
    assert stack.effects(stack.action(handle.action_id).idempotency_key) == 0


def test_unknown_tool_is_named_at_pin_check_and_publish(stack: Stack, pins: Path, tmp_path: Path) -> None:
    contracts = tmp_path / "contracts"
    contracts.mkdir()
    for source in (ROOT / "contracts").glob("*.yaml"):
        (contracts / source.name).write_text(source.read_text())
    typo = yaml.safe_load((contracts / "ticket.create.yaml").read_text())
    typo.update(action_type="ticket.open", tool="create_tiket")
    (contracts / "ticket.open.yaml").write_text(yaml.safe_dump(typo))
    local_pins = tmp_path / "pins.json"
    pinned = pin(stack, local_pins, "pin", PROOFLINE_CONTRACTS_DIR=str(contracts))
    assert pinned.returncode == 1
    assert "unknown_tool  ticket.open: server 'sor' has no tool 'create_tiket'" in pinned.stderr
    checked = pin(stack, local_pins, "check", PROOFLINE_CONTRACTS_DIR=str(contracts))
    assert checked.returncode == 1 and "unknown_tool  ticket.open" in checked.stderr
    assert "ticket.create" not in checked.stderr  # the other contracts are fine
    settings = stack.settings.model_copy(update={"pins_file": local_pins, "contracts_dir": contracts})
    action_id = f"typo-{time.monotonic_ns()}"
    with Client(settings, app=stack.app, database_url=stack.urls["controller"]) as c:
        with pytest.raises(UnknownTool) as raised:
            c.publish("ticket.open", tenant="acme", action_id=action_id, target={"type": "ticket_queue", "id": "x"},
                      arguments={"tenant": "acme", "title": "t", "owner": "ops"})
    assert raised.value.code == "unknown_tool" and "create_tiket" in raised.value.detail
    assert stack.action(action_id) is None  # refused before anything was recorded or sent


def test_the_pin_holds_every_tool_the_contracts_use_with_its_input_schema(pins: Path) -> None:
    pinned = json.loads(pins.read_text())["servers"]["sor"]
    # Write tools, precondition reads (get_account, find_ticket_by_key ...) and verification reads.
    assert {"create_ticket", "find_ticket_by_key", "get_account", "find_refund_by_key", "get_operation"} <= set(
        pinned["tools"])
    assert set(pinned["input_schemas"]) == set(pinned["tools"])
    assert "owner" in pinned["input_schemas"]["create_ticket"]["required"]


def test_the_sdk_checks_arguments_against_the_pinned_schema(stack: Stack, client: Client) -> None:
    action_id = f"sdk-args-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ArgumentsInvalid) as raised:
        client.publish("ticket.create", tenant="acme", action_id=action_id, target={"type": "ticket_queue", "id": "x"},
                       arguments={"tenant": "acme", "title": "no owner"})
    assert raised.value.code == "arguments_invalid" and "$: 'owner' is a required property" in raised.value.detail
    assert stack.action(action_id) is None  # refused before it was signed, recorded or sent


def test_a_bad_action_id_is_a_proofline_error_not_pydantic_s(stack: Stack, client: Client) -> None:
    with pytest.raises(MalformedEnvelope) as raised:
        ticket(client, action_id="two words")
    assert raised.value.code == "envelope_malformed" and raised.value.context["field"] == "action_id"
    assert stack.action("two words") is None


def test_a_broker_that_does_not_take_the_message_is_a_proofline_error(stack: Stack, pins: Path) -> None:
    """Recorded, then not sent: ``broker_unavailable`` (retryable) naming the action, never kombu's
    own error; the record stays and the stack's reconciler sends the action from the ledger."""
    away = stack.settings.model_copy(update={"pins_file": pins,
                                             "broker_url": SecretStr(f"redis://127.0.0.1:{free_port()}/0")})
    with Client(away, database_url=stack.urls["controller"]) as c, pytest.raises(BrokerUnavailable) as raised:
        ticket(c, action_id=(action_id := f"sdk-away-{uuid.uuid4().hex[:8]}"))
    assert raised.value.code == "broker_unavailable" and raised.value.retryable
    assert action_id in str(raised.value) and "recorded as published" in str(raised.value)
    row = stack.wait_settled(action_id, timeout=90)
    assert row.outcome == Outcome.completed_verified and "redriven" in stack.events(action_id)


def test_a_misspelled_read_tool_or_recovery_fails_pin_and_check(stack: Stack, pins: Path, tmp_path: Path) -> None:
    """What the worker would resolve at run time, resolved before: every tool a contract uses, and
    the contract its recovery derives. The worker used to retry a misspelled read until the deadline."""
    contracts = tmp_path / "contracts"
    contracts.mkdir()
    for source in (ROOT / "contracts").glob("*.yaml"):
        (contracts / source.name).write_text(source.read_text())
    typo = yaml.safe_load((contracts / "ticket.create.yaml").read_text())
    typo["precondition_read"]["tool"] = "find_ticket_by_kee"
    (contracts / "ticket.create.yaml").write_text(yaml.safe_dump(typo))
    refund_contract = yaml.safe_load((contracts / "refund.issue.yaml").read_text())
    refund_contract["recovery"]["compensation"]["action_type"] = "refund.revers"
    (contracts / "refund.issue.yaml").write_text(yaml.safe_dump(refund_contract))
    expected = "unknown_tool  ticket.create: server 'sor' has no tool 'find_ticket_by_kee' (precondition_read.tool)"

    local_pins = tmp_path / "pins.json"
    local_pins.write_text(pins.read_text())
    checked = pin(stack, local_pins, "pin", "--check", PROOFLINE_CONTRACTS_DIR=str(contracts))
    assert checked.returncode == 1 and expected in checked.stderr, checked.stderr
    # Offline: the pins list every tool the server had; the misspelling is not among them.
    offline = pin(stack, local_pins, "check", PROOFLINE_CONTRACTS_DIR=str(contracts))
    assert offline.returncode == 1 and expected in offline.stderr, offline.stderr
    assert ("unknown_action_type  refund.issue: recovery.compensation.action_type 'refund.revers' has no contract"
            in offline.stderr)
    pinned = pin(stack, tmp_path / "fresh.json", "pin", PROOFLINE_CONTRACTS_DIR=str(contracts))
    assert pinned.returncode == 1 and expected in pinned.stderr
    # The correctly spelled contracts are not blamed.
    assert "service.restart" not in offline.stderr + pinned.stderr


def test_the_ledger_notifies_when_an_action_settles(stack: Stack, client: Client) -> None:
    import psycopg

    from ledger.settled import CHANNEL

    with psycopg.connect(stack.urls["reader"], autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        handle = ticket(client)
        heard: list[str] = []
        deadline = time.monotonic() + 60
        while handle.action_id not in heard and time.monotonic() < deadline:
            heard += [n.payload for n in listener.notifies(timeout=1.0)]
    assert handle.action_id in heard
    assert handle.status().settled  # notified only once the settled state could be read


def test_wait_falls_back_to_polling_when_nothing_is_notified(stack: Stack, client: Client) -> None:
    import psycopg

    from ledger.settled import CHANNEL

    with psycopg.connect(stack.admin_url, autocommit=True) as admin, \
            psycopg.connect(stack.urls["reader"], autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        admin.execute("ALTER TABLE actions DISABLE TRIGGER actions_notify_settled")
        try:
            handle = ticket(client)
            result = handle.wait(timeout=60)
            heard = [n.payload for n in listener.notifies(timeout=0.5)]
        finally:
            admin.execute("ALTER TABLE actions ENABLE TRIGGER actions_notify_settled")
    assert result.verified
    assert handle.action_id not in heard  # no notification came: the outcome was read by polling


def test_a_refused_message_stops_its_batch_and_is_recorded(stack: Stack, client: Client) -> None:
    from proofline.errors import ContractMismatch

    def refusals() -> int:
        with stack.conn.cursor() as cur:
            cur.execute("SELECT count(*) AS n FROM ledger_events WHERE event = 'publish_refused'")
            return cur.fetchone()["n"]

    good = client.prepare("ticket.create", tenant="acme", target={"type": "ticket_queue", "id": "acme-ops"},
                          arguments={"tenant": "acme", "title": "fine", "owner": "ops"})
    bad = client.prepare("ticket.create", tenant="acme", target={"type": "account", "id": "acme-ops"},
                         arguments={"tenant": "acme", "title": "wrong target type", "owner": "ops"})
    before = refusals()
    with pytest.raises(ContractMismatch):
        client.publish_many([good, bad])
    assert stack.action(good.action_id) is None and stack.action(bad.action_id) is None
    assert refusals() == before + 1


def test_a_conflicting_action_id_in_a_batch_is_refused_and_the_rest_published(stack: Stack, client: Client) -> None:
    from proofline.errors import IdempotencyConflict

    first = ticket(client)
    again = {"action_type": "ticket.create", "tenant": "acme", "action_id": first.action_id,
             "target": {"type": "ticket_queue", "id": "acme-ops"},
             "arguments": {"tenant": "acme", "title": "other arguments", "owner": "ops"}}
    other = {**again, "action_id": f"act-{uuid.uuid4().hex}", "arguments": {**again["arguments"], "title": "new"}}
    conflicting, published = client.publish_many([again, other])
    with pytest.raises(IdempotencyConflict):
        conflicting.wait(timeout=5)
    assert "publish_refused" in stack.events(first.action_id)
    assert first.wait(timeout=60).verified and published.wait(timeout=60).verified


def test_the_checked_in_pins_match_the_demo_server(stack: Stack) -> None:
    checked = pin(stack, ROOT / "contracts" / "pins.json", "pin", "--check")
    assert checked.returncode == 0, checked.stderr
    assert "ok  sor 1.0.0" in checked.stdout
