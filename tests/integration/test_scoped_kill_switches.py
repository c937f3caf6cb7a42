"""Kill switches scoped by server and tool (``SERVER:TOOL``), with two real servers that expose a
tool of the same name: containing one server's ``create_ticket`` leaves the other's running. The
old tool-only form is accepted (it means the tool on every server, ``*:TOOL``), and migration 0020
rewrites switches stored in it."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import yaml
from psycopg.rows import dict_row

from ledger.migrate import upgrade
from ledger.states import Outcome
from proofline_kit.resources import drop_database, with_database
from tests.conftest import ROOT, Stack, build_stack, start_workers, teardown_stack
from tests.integration.cli_run import as_json, assert_error, proofline, text

WHO = ["--by", "ops@example.com", "--why", "drill"]
#: A second server: the same program under another name, so both expose ``create_ticket``.
OTHER = "desk"


def _contracts(tmp: Path) -> Path:
    """The repository's contracts, and ``desk.ticket.create``: ticket.create on the other server."""
    target = tmp / "contracts"
    shutil.copytree(ROOT / "contracts", target)
    spec = yaml.safe_load((target / "ticket.create.yaml").read_text())
    spec.update(action_type="desk.ticket.create", server=OTHER)
    spec["recovery"].pop("compensation", None)
    (target / "desk.ticket.create.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return target


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("scoped-switches")
    s = build_stack("stdio", tmp, extra_env={"PROOFLINE_CONTRACTS_DIR": str(_contracts(tmp))})
    try:
        servers = yaml.safe_load(s.servers_file.read_text())
        servers["servers"][OTHER] = servers["servers"]["sor"]
        s.servers_file.write_text(yaml.safe_dump(servers, sort_keys=False))
        start_workers(s)
        yield s
    finally:
        teardown_stack(s)


def _ticket(stack: Stack, action_type: str, tenant: str = "acme") -> str:
    env = stack.envelope(action_type, tenant=tenant, target={"type": "ticket_queue", "id": f"{tenant}-ops"},
                         arguments={"tenant": tenant, "title": f"t-{uuid.uuid4().hex[:8]}", "owner": "ops"})
    stack.publish(env)
    return env.action_id


def _outcomes(stack: Stack, *action_ids: str) -> list[tuple[Outcome | None, str | None]]:
    rows = [stack.wait_settled(a, timeout=60) for a in action_ids]
    return [(r.outcome, r.reason_code) for r in rows]


BLOCKED = (Outcome.not_started, "kill_switch_engaged")


def test_a_server_scoped_switch_blocks_that_server_only(stack: Stack) -> None:
    out = as_json(proofline(stack, "--json", "kill", "set", "--scope", "tool", "--value", "sor:create_ticket", *WHO))
    assert out == {"scope": "tool", "value": "sor:create_ticket", "engaged": True}
    try:
        mine, other = _ticket(stack, "ticket.create"), _ticket(stack, "desk.ticket.create")
        (blocked, ran) = _outcomes(stack, mine, other)
        assert blocked == BLOCKED and ran[0] == Outcome.completed_verified, (blocked, ran)
    finally:
        assert "cleared" in text(proofline(stack, "kill", "clear", "--scope", "tool", "--value", "sor:create_ticket",
                                           *WHO))
    assert _outcomes(stack, _ticket(stack, "ticket.create"))[0][0] == Outcome.completed_verified


def test_the_tool_only_form_means_every_server_and_clears_in_either_form(stack: Stack) -> None:
    out = as_json(proofline(stack, "--json", "kill", "set", "--scope", "tool", "--value", "create_ticket", *WHO))
    assert out["value"] == "*:create_ticket" and out["engaged"]
    try:
        listed = as_json(proofline(stack, "--json", "kill", "list"))["kill_switches"]
        assert [(r["scope"], r["value"]) for r in listed] == [("tool", "*:create_ticket")]
        assert _outcomes(stack, _ticket(stack, "ticket.create"), _ticket(stack, "desk.ticket.create")) == [BLOCKED] * 2
    finally:
        # The old form names the migrated value.
        assert "cleared" in text(proofline(stack, "kill", "clear", "--scope", "tool", "--value", "create_ticket", *WHO))
    assert as_json(proofline(stack, "--json", "kill", "list"))["kill_switches"] == []


def test_a_tenant_scoped_switch_names_server_tool_and_tenant(stack: Stack) -> None:
    value = f"{OTHER}:create_ticket@acme"
    # --any-tenant: whether tenant acme has acted yet on this stack depends on which tests ran first.
    assert "set" in text(proofline(stack, "kill", "set", "--scope", "tool_tenant", "--value", value, "--any-tenant",
                                   *WHO))
    try:
        blocked, ran, other_tenant = _outcomes(stack, _ticket(stack, "desk.ticket.create"),
                                               _ticket(stack, "ticket.create"),
                                               _ticket(stack, "desk.ticket.create", tenant="globex"))
        assert blocked == BLOCKED and ran[0] == other_tenant[0] == Outcome.completed_verified
    finally:
        proofline(stack, "kill", "clear", "--scope", "tool_tenant", "--value", value, *WHO)
    assert_error(proofline(stack, "kill", "set", "--scope", "tool", "--value", "ticketing:create_ticket", *WHO), 12,
                 "kill_switch_invalid", "no server 'ticketing'")


def test_migration_0020_makes_old_switches_explicit(stack: Stack) -> None:
    """Switches stored before 0020 (tool names only) cover that tool on every server: the migration
    writes that down as ``*:TOOL`` (``*:TOOL@TENANT``) and leaves scoped and other values alone."""
    name = f"pl_switches_{uuid.uuid4().hex[:8]}"
    maintenance = stack.admin_url
    with psycopg.connect(maintenance, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    admin = with_database(maintenance, name)
    try:
        upgrade(admin, "0016")
        rows = [("tool", "create_ticket"), ("tool_tenant", "issue_refund@acme"), ("tenant", "acme"),
                ("action_type", "ticket.create")]
        with psycopg.connect(admin, autocommit=True) as conn:
            for scope, value in rows:
                conn.execute("INSERT INTO kill_switches (scope, value, set_by, reason) VALUES (%s, %s, 'ops', 'old')",
                             (scope, value))
        upgrade(admin)
        with psycopg.connect(admin, row_factory=dict_row) as conn:
            got = {(r["scope"], r["value"]) for r in conn.execute("SELECT scope, value FROM kill_switches")}
        assert got == {("tool", "*:create_ticket"), ("tool_tenant", "*:issue_refund@acme"), ("tenant", "acme"),
                       ("action_type", "ticket.create")}
    finally:
        drop_database(admin)
