"""Pure logic behind the command line: kill switch values, the exit code of each error class,
``--since``, and how Flower renders a task summary."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import click
import psycopg
import pytest
from pydantic import ValidationError

from ledger.states import KillSwitchScope as S
from proofline import errors
from proofline.commands import exit_codes
from proofline.commands.base import since_value
from proofline.settings import Settings
from worker.flower_config import format_task

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


def test_flower_renders_a_proofline_summary_and_leaves_others_alone():
    task = SimpleNamespace(result="{'outcome': 'not_started', 'reason_code': 'kill_switch_engaged', "
                                  "'status': 'closed', 'action_id': 'a-1'}")
    assert format_task(task).result == "not_started / kill_switch_engaged (closed)"
    other = SimpleNamespace(result="42")
    assert format_task(other).result == "42"
    broken = SimpleNamespace(result="{'status': ")
    assert format_task(broken).result == "{'status': "
