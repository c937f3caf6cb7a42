"""Contracts load at run time: a contract added to the folder while a worker runs is executed by
that worker without a restart, and an edited one is used from the next action on (its new digest
in the action's ``validated`` event). Real worker, real system-of-record server."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.settings import ROOT
from tests.conftest import Stack, build_stack, start_workers, teardown_stack
from tests.helpers import evidence_of, uid


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("reload")
    contracts = tmp / "contracts"
    shutil.copytree(ROOT / "contracts", contracts)
    s = build_stack("stdio", tmp / "stack", extra_env={"PROOFLINE_CONTRACTS_DIR": str(contracts)})
    try:
        start_workers(s)
        yield s
    finally:
        teardown_stack(s)


def open_ticket(stack: Stack, action_type: str):
    env = stack.envelope(action_type, arguments={"tenant": "acme", "title": f"t-{uid()}", "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"})
    stack.publish(env)
    return env, stack.wait_settled(env.action_id)


def test_a_contract_added_while_the_worker_runs_is_executed_without_a_restart(stack: Stack) -> None:
    folder = stack.settings.contracts_dir
    text = (folder / "ticket.create.yaml").read_text()
    (folder / "ticket.raise.yaml").write_text(text.replace("action_type: ticket.create", "action_type: ticket.raise"))
    env, row = open_ticket(stack, "ticket.raise")
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row
    first = evidence_of(stack, env.action_id, "validated")[0]
    assert first["contract"] == "ticket.raise"
    # An edit is taken too: the next action runs under the new version, named by its digest.
    (folder / "ticket.raise.yaml").write_text(text.replace("action_type: ticket.create", "action_type: ticket.raise")
                                              .replace("version: 1", "version: 2"))
    # A worker looks at the folder at most once a second: an action taken just after the edit may
    # still run under version 1. Within a few looks every action runs under version 2.
    for _ in range(20):
        later, row = open_ticket(stack, "ticket.raise")
        assert row.outcome == Outcome.completed_verified
        second = evidence_of(stack, later.action_id, "validated")[0]
        if second["contract_version"] == 2:
            break
    assert second["contract_version"] == 2 and second["contract_digest"] != first["contract_digest"]
