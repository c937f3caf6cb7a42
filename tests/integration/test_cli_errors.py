"""Every error path of the command line against real services: one line on stderr, the exit code of
the error's class, no traceback (``--debug`` adds it), and nothing lost or half-recorded."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.commands import exit_codes
from proofline.contracts import contract_for
from proofline.errors import ContractInvalid
from proofline.settings import ROOT
from tests.conftest import Stack, free_port
from tests.integration.cli_run import as_json, assert_error, proofline


def _ticket_args(action_id: str, tenant: str = "acme", title: str = "from the cli") -> list[str]:
    return ["publish", "--action-type", "ticket.create", "--tenant", tenant,
            "--target", json.dumps({"type": "ticket_queue", "id": f"{tenant}-ops"}),
            "--args", json.dumps({"tenant": tenant, "title": title, "owner": "ops"}),
            "--run-id", f"run-{action_id}", "--action-id", action_id]


def test_a_missing_database_is_one_line_with_its_exit_code(stack: Stack) -> None:
    nowhere = f"postgresql://proofline_reader@127.0.0.1:{free_port()}/proofline"
    env = {"PROOFLINE_READER_DATABASE_URL": nowhere, "PROOFLINE_DATABASE_URL": nowhere}
    out = proofline(stack, "status", "act-1", env=env)
    assert_error(out, 4, "database_unavailable", "reader", str(nowhere.rsplit(":", 1)[1].split("/")[0]))
    listing = proofline(stack, "actions", "list", env=env)
    assert_error(listing, 4, "database_unavailable")
    # --json: the same error as one JSON line on stderr; --debug: the traceback as well.
    machine = proofline(stack, "--json", "status", "act-1", env=env)
    assert machine.returncode == 4 and machine.stdout == ""
    assert json.loads(machine.stderr) == {"error": "database_unavailable", "exit_code": 4,
                                          "message": json.loads(machine.stderr)["message"]}
    debug = proofline(stack, "--debug", "status", "act-1", env=env)
    assert debug.returncode == 4 and "Traceback" in debug.stderr
    assert debug.stderr.rstrip().splitlines()[-1].startswith("proofline: database_unavailable: ")


def test_bad_json_in_target_is_a_usage_error_and_records_nothing(stack: Stack) -> None:
    action_id = f"cli-badjson-{uuid.uuid4().hex[:8]}"
    args = _ticket_args(action_id)
    args[args.index("--target") + 1] = '{"type": "ticket_queue", "id": '
    out = proofline(stack, *args)
    assert_error(out, 2, "usage", "--target", "not JSON")
    assert stack.action(action_id) is None
    args[args.index("--target") + 1] = '["a", "list"]'
    assert_error(proofline(stack, *args), 2, "usage", "--target", "JSON object")


def test_arguments_that_miss_the_pinned_schema_are_refused_before_anything_is_recorded(stack: Stack) -> None:
    """The packaged pins hold create_ticket's input schema: an action without its required owner was
    once called twice and escalated; now publish refuses it with the schema's path."""
    action_id = f"cli-args-{uuid.uuid4().hex[:8]}"
    args = _ticket_args(action_id)
    args[args.index("--args") + 1] = json.dumps({"tenant": "acme", "title": "no owner"})
    assert_error(proofline(stack, *args), 8, "arguments_invalid", "'create_ticket'", "$: 'owner' is a required property")
    args[args.index("--args") + 1] = json.dumps({"tenant": "acme", "title": 7, "owner": "ops"})
    assert_error(proofline(stack, *args), 8, "arguments_invalid", "$.title: 7 is not of type 'string'")
    assert stack.action(action_id) is None


def test_a_malformed_action_id_is_an_envelope_error(stack: Stack) -> None:
    args = _ticket_args("has a space")
    assert_error(proofline(stack, *args), 8, "envelope_malformed", "action_id")
    assert stack.action("has a space") is None


def test_an_unknown_action_type_is_named(stack: Stack) -> None:
    action_id = f"cli-unknown-{uuid.uuid4().hex[:8]}"
    args = _ticket_args(action_id)
    args[args.index("--action-type") + 1] = "ticket.crate"
    assert_error(proofline(stack, *args), 7, "unknown_action_type", "'ticket.crate'")
    assert stack.action(action_id) is None


def test_manual_resolve_of_an_action_that_is_not_escalated_is_refused(stack: Stack) -> None:
    action_id = f"cli-resolve-{uuid.uuid4().hex[:8]}"
    assert proofline(stack, *_ticket_args(action_id)).returncode == 0
    row = stack.wait_settled(action_id)
    assert row.status == ActionStatus.closed and row.outcome == Outcome.completed_verified
    resolve = ["manual", "resolve", action_id, "--as", "failed", "--by", "ops@example.com", "--reason", "drill"]
    assert_error(proofline(stack, *resolve), 10, "transition_refused", action_id, "closed, not escalated")
    after = stack.action(action_id)
    assert (after.status, after.outcome) == (row.status, row.outcome)
    assert "operator_intervention" not in stack.events(action_id)
    missing = ["manual", "resolve", f"{action_id}-nope", *resolve[3:]]
    assert_error(proofline(stack, *missing), 6, "not_found")
    assert_error(proofline(stack, "status", f"{action_id}-nope"), 6, "not_found", "no action")


def test_an_idempotency_conflict_is_one_line_and_keeps_the_first_publication(stack: Stack) -> None:
    action_id = f"cli-conflict-{uuid.uuid4().hex[:8]}"
    first = as_json(proofline(stack, "--json", *_ticket_args(action_id, title="first")))
    assert first["action_id"] == action_id and first["republished"] is False
    row = stack.wait_settled(action_id)
    out = proofline(stack, *_ticket_args(action_id, title="second, different arguments"))
    assert_error(out, 9, "idempotency_conflict", action_id)
    assert stack.action(action_id).idempotency_key == row.idempotency_key
    assert stack.effects(row.idempotency_key) == 1
    assert "publish_refused" in stack.events(action_id)


def test_contracts_check_names_the_broken_file_and_field_and_the_others_still_work(stack: Stack, tmp_path) -> None:
    folder = tmp_path / "contracts"
    shutil.copytree(stack.settings.contracts_dir, folder)
    broken = folder / "ticket.close.yaml"
    broken.write_text(broken.read_text().replace("\ntool: close_ticket", "\ntol: close_ticket"))
    (folder / "ticket.create.yaml").write_text((folder / "ticket.create.yaml").read_text().replace(
        'expr: "!before.found"', 'expr: "!before.found &&"'))
    out = proofline(stack, "contracts", "check", "--dir", str(folder))
    assert out.returncode == exit_codes.CHECK_FAILED
    refused = out.stderr.splitlines()  # one line per refused file
    assert all(line.startswith("refused  ") for line in refused), out.stderr
    assert len(refused) == 2, out.stdout
    assert any("ticket.close.yaml" in line and "tool: Field required" in line for line in refused)
    assert any("ticket.create.yaml" in line and "preconditions.0.expr (no_ticket_for_this_key)" in line
               for line in refused)
    assert sum(line.startswith("ok ") for line in out.stdout.splitlines()) == 3
    report = json.loads(proofline(stack, "--json", "contracts", "check", "--dir", str(folder)).stdout)
    assert {r["file"] for r in report["refused"]} == {"ticket.close.yaml", "ticket.create.yaml"}
    # At runtime the same folder refuses only its own broken action types, naming the file.
    env = {"PROOFLINE_CONTRACTS_DIR": str(folder)}
    action_id = f"cli-contract-{uuid.uuid4().hex[:8]}"
    assert_error(proofline(stack, *_ticket_args(action_id), env=env), 7, "contract_invalid", "ticket.create.yaml")
    assert stack.action(action_id) is None
    assert contract_for(folder, "refund.issue").tool == "issue_refund"
    with pytest.raises(ContractInvalid, match="ticket.close.yaml"):
        contract_for(folder, "ticket.close")
    assert proofline(stack, "contracts", "check").returncode == 0  # the stack's own folder is intact


def test_every_exit_code_is_distinct_and_documented() -> None:
    codes = [code for code, _, _ in exit_codes.TABLE] + [code for code, _, _ in exit_codes.OTHER_ROWS]
    assert len(codes) == len(set(codes))
    # The command line reference documents them (docs/reference/cli.md, "Errors and exit codes").
    reference = (ROOT / "docs" / "reference" / "cli.md").read_text()
    for line in exit_codes.markdown_table().splitlines()[2:]:
        assert line in reference, line


def test_a_broker_that_is_away_after_recording_says_what_happens_next(stack: Stack) -> None:
    """The action is recorded before it is sent: the CLI says so (exit 5) instead of reporting a
    failure for an action that will run, and the reconciler sends it from the ledger."""
    action_id = f"cli-broker-{uuid.uuid4().hex[:8]}"
    away = {"PROOFLINE_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"}
    out = proofline(stack, *_ticket_args(action_id), env=away, timeout=180)
    assert_error(out, 5, "broker_unavailable", action_id, "recorded", "reconciler")
    assert stack.action(action_id) is not None
    row = stack.wait_settled(action_id, timeout=90)
    assert row.outcome == Outcome.completed_verified and stack.effects(row.idempotency_key) == 1
    assert "redriven" in stack.events(action_id)
