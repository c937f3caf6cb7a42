"""Pure logic behind the command line: kill switch values, the exit code of each error class,
``--since``, and how Flower renders a task summary."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import click
import psycopg
import pytest
from pydantic import ValidationError

from ledger.states import KillSwitchScope as S
from proofline import errors
from proofline.commands import exit_codes
from proofline.commands.base import since_value
from proofline.settings import Settings
from worker.summary import flower_state, parse_line, task_line
from worker.task_request import shown

KNOWN = {"action_types": ["ticket.create"], "tools": ["create_ticket"], "tenants": ["acme"], "servers": ["sor"]}


@pytest.mark.parametrize(("scope", "value", "says"), [
    (S.tool, "", "needs a value"),
    (S.tool_tenant, "create_ticket", "TOOL@TENANT"),
    (S.tool_tenant, "create_ticket@", "TOOL@TENANT"),
    (S.tool_tenant, "@acme", "TOOL@TENANT"),
    (S.tool_tenant, "create_ticket@acme@x", "TOOL@TENANT"),
    (S.tool_tenant, "crate_ticket@acme", "no tool 'crate_ticket'"),
    (S.tool_tenant, "create_ticket@umbrella", "no tenant 'umbrella'"),
    (S.tool_tenant, "ticketing:create_ticket@acme", "no server 'ticketing'"),
    (S.tool_tenant, "sor:@acme", "TOOL@TENANT"),
    (S.tool, "sor:", "SERVER:TOOL"),
    (S.tool, ":create_ticket", "SERVER:TOOL"),
    (S.tool, "ticketing:create_ticket", "no server 'ticketing'"),
    (S.tool, "sor:create_ticket@acme", "tool_tenant"),
    (S.action_type, "ticket.crate", "no action type 'ticket.crate'"),
    (S.tenant, "umbrella", "--any-tenant"),
    (S.global_, "acme", "takes no value"),
])
def test_a_switch_that_would_block_nothing_is_refused(scope, value, says):
    from recovery.operator import check_switch

    with pytest.raises(errors.KillSwitchInvalid, match=says):
        check_switch(scope, value, **KNOWN)


def test_valid_switches_keep_their_value():
    from recovery.operator import check_switch

    # Tool switches are scoped by server; the old tool-only form means the tool on every server.
    assert check_switch(S.tool_tenant, " create_ticket@acme ", **KNOWN) == "*:create_ticket@acme"
    assert check_switch(S.tool_tenant, "sor:create_ticket@acme", **KNOWN) == "sor:create_ticket@acme"
    assert check_switch(S.tool, "create_ticket", **KNOWN) == "*:create_ticket"
    assert check_switch(S.tool, " sor:create_ticket", **KNOWN) == "sor:create_ticket"
    assert check_switch(S.tool, "*:create_ticket", **KNOWN) == "*:create_ticket"
    assert check_switch(S.tool, "ticketing:create_ticket", **{**KNOWN, "servers": None}) == "ticketing:create_ticket"
    assert check_switch(S.global_, "", **KNOWN) == ""
    assert check_switch(S.tenant, "umbrella", **{**KNOWN, "tenants": None}) == "umbrella"


@pytest.mark.parametrize(("exc", "code", "name"), [
    (click.UsageError("x"), 2, "usage"),
    (errors.ConfigurationError("x"), 3, "configuration_error"),
    (errors.SchemaMissing("x"), 3, "schema_missing"),
    (errors.DatabaseUnavailable("x"), 4, "database_unavailable"),
    (psycopg.OperationalError("x"), 4, "database_unavailable"),
    (errors.BrokerUnavailable("x"), 5, "broker_unavailable"),
    (errors.NotFound("x"), 6, "not_found"),
    (errors.UnknownActionType("x"), 7, "unknown_action_type"),
    (errors.ContractInvalid("x"), 7, "contract_invalid"),
    (errors.BadSignature("x"), 8, "envelope_bad_signature"),
    (errors.IdempotencyConflict("x"), 9, "idempotency_conflict"),
    (errors.TransitionRefused("x"), 10, "transition_refused"),
    (errors.EffectNotProvenAbsent("x"), 11, "effect_not_proven_absent"),
    (errors.KillSwitchInvalid("x"), 12, "kill_switch_invalid"),
    (errors.PrivilegeRefused("x"), 13, "privilege_refused"),
    (errors.ApprovalExpired("x"), 14, "approval_expired"),
    (errors.FollowTimedOut("x"), 15, "follow_timed_out"),
    (errors.CheckpointInvalid("x"), 16, "checkpoint_invalid"),
    (ZeroDivisionError("x"), 70, "internal_error"),
])
def test_each_error_class_has_its_exit_code(exc, code, name):
    assert exit_codes.classify(exc) == (code, name)


def test_bad_settings_are_a_configuration_error():
    with pytest.raises(ValidationError) as err:
        Settings(lease_ttl_seconds="soon")
    assert exit_codes.classify(err.value) == (3, "configuration_error")
    assert "\n" not in exit_codes.one_line(exit_codes.message(err.value))


def test_since_takes_an_age_or_a_timestamp():
    now = datetime.now(UTC)
    assert abs(since_value("15m") - (now - timedelta(minutes=15))) < timedelta(seconds=5)
    assert since_value("2026-11-30T21:00:00") == datetime(2026, 11, 30, 21, tzinfo=UTC)
    with pytest.raises(click.BadParameter):
        since_value("yesterday")


def test_a_task_line_leads_with_outcome_and_action_and_names_a_state_flower_does_not_paint_green():
    killed = task_line({"status": "closed", "reason_code": "kill_switch_engaged", "action_id": "a-1",
                        "outcome": "not_started"})
    assert killed == "outcome=not_started action=a-1 reason=kill_switch_engaged status=closed"
    cases = {
        killed: "KILL_SWITCHED",
        "outcome=completed_verified action=a-2 reason=verified status=closed": "SUCCESS",
        "outcome=completed_unverified action=a-3 reason=- status=verifying": "UNVERIFIED",
        "outcome=unknown_outcome action=a-3 reason=transport_timeout status=verifying": "UNKNOWN_OUTCOME",
        "outcome=accepted action=a-3 reason=operation_accepted status=verifying": "ACCEPTED",
        "outcome=- action=a-3 reason=- status=pending": "SUCCESS",
        "outcome=unknown_outcome action=a-4 reason=verification_absent status=escalated": "ESCALATED",
        "outcome=unknown_outcome action=a-4 reason=x status=escalated recovery=containment": "CONTAINED",
        "outcome=failed_after_side_effect action=a-5 reason=x status=closed": "ACTION_FAILED",
        "outcome=not_started action=a-6 reason=stale_version status=closed": "NOT_STARTED",
        "outcome=- action=- reason=message_malformed status=refused": "REFUSED",
        "outcome=completed_verified action=a-7 reason=x status=closed task=refused": "REFUSED",
    }
    for line, state in cases.items():
        fields = parse_line(line)
        assert fields is not None and flower_state(fields) == state, line
    # What Celery's event carries is the repr of the return value; the request class reads it back.
    assert shown(repr(killed)) == ("KILL_SWITCHED", killed)
    assert shown("42") is None and shown("'outcome=cut off") is None and shown("{'status': ") is None
    # An action id with a space or a quote stays one word, and the line still parses.
    odd = task_line({"status": "closed", "action_id": 'a "b" c', "outcome": "completed_verified"})
    assert parse_line(odd)["action"] == '"a \\"b\\" c"' and flower_state(parse_line(odd)) == "SUCCESS"
    assert task_line({"skipped": 1}) == {"skipped": 1}
