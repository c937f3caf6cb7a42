"""Proposals approved, denied and refused in the console, in a real browser, against a real stack
under a signed authority policy (the stack of tests/integration/test_authority.py: Postgres, Redis,
a Celery worker, the system-of-record MCP server behind a witness relay, two approver keys).

The console runs as its own process with approver users bound to those keys. A proposal is made by
the worker (mode ``propose``); the approval signed in the console must be what releases it, and the
action must then run exactly once and be verified: counted by the witness relay and the system of
record, never by the console's own word."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from ledger.states import ActionStatus, Outcome
from proofline.canonical import sha256_hex
from proofline.console.access import ConsoleRole, add_user
from proofline.plan import plan_diff
from proofline_kit.sor import store as sor
from tests.console.conftest import Console, chromium, log_in, running_console, shot
from tests.helpers import evidence_of, uid
from tests.integration.test_authority import Authority, auth, close_env, proposed_close, wait_status  # noqa: F401

TWO_PERSON = {"ticket.purge": {"mode": "propose", "approvers_required": 2}}


@pytest.fixture(scope="module")
def approvers_console(auth: Authority) -> Iterator[Console]:  # noqa: F811 - the imported fixture
    where = auth.policy_file.parent
    users = where / "console-users.json"
    tokens = {"apr-alice": add_user(users, "apr-alice", ConsoleRole.approver, where / "alice.key"),
              "apr-bob": add_user(users, "apr-bob", ConsoleRole.approver, where / "bob.key"),
              "ops-carol": add_user(users, "ops-carol", ConsoleRole.operator),
              "viewer-dan": add_user(users, "viewer-dan", ConsoleRole.viewer)}
    with running_console(auth.stack, users, tokens) as running:
        yield running


@pytest.fixture(scope="module")
def browser(auth: Authority) -> Iterator[Any]:  # noqa: F811
    with chromium(auth.stack) as launched:
        yield launched


def proposed_purge(a: Authority):
    """A point of no return under a two-person rule, waiting for approvers."""
    a.policy(**TWO_PERSON)
    env = close_env(a.stack, "ticket.purge")
    a.stack.publish(env)
    wait_status(a.stack, env.action_id, ActionStatus.proposed)
    return env


def approve_in_page(page: Any, action_id: str, *, covers: bool = False, note: str = "") -> str:
    page.goto(f"/proposals/{action_id}")
    if covers:
        page.check("#approve-form input[name=covers_irreversible]")
    page.fill("#approve-form input[name=note]", note)
    page.click("#approve-form button")
    page.wait_for_selector("#message, #error")
    return page.inner_text("#message") if page.locator("#message").count() else page.inner_text("#error")


def ran_once(a: Authority, env) -> dict:
    row = a.stack.wait_settled(env.action_id)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row
    assert a.stack.witness.count(key=env.idempotency_key) == 1
    assert a.stack.effects(env.idempotency_key) == 1
    return evidence_of(a.stack, env.action_id, "revalidated")[-1]["authority"]


def test_an_approver_approves_a_proposal_and_it_runs_once_verified(auth: Authority,  # noqa: F811
                                                                   approvers_console: Console, browser: Any) -> None:
    env = proposed_close(auth)
    proposed = evidence_of(auth.stack, env.action_id, "proposed")[0]
    page = log_in(browser, approvers_console, "apr-alice")
    page.goto("/proposals")
    row = page.locator(f"#proposals tr[data-action='{env.action_id}']")
    assert row.locator(".count").inner_text() == "0 of 1"
    row.locator("a").click()
    page.wait_for_selector("#approve-form")
    assert page.inner_text("#plan-hash") == proposed["plan_hash"]
    assert json.loads(page.inner_text("#plan")) == proposed["content"]
    assert page.inner_text("#approving-as") == "alice@example.com"
    assert page.locator("#approve-form input[name=covers_irreversible]").count() == 0  # not a point of no return
    assert page.locator("#no-diff").count() == 1  # one plan recorded: nothing to compare
    shot(page, "proposal")
    assert auth.stack.witness.count(key=env.idempotency_key) == 0
    said = approve_in_page(page, env.action_id, note="checked the ticket with the customer")
    assert said == f"{env.action_id} approved by alice@example.com (1 of 1): sent to the workers"
    authority = ran_once(auth, env)
    assert authority["approvals"]["approvers"] == ["alice@example.com"]
    [recorded] = [e for e in auth.stack.timeline(env.action_id) if e["event"] == "approval_recorded"]
    assert recorded["actor"] == "alice@example.com"
    assert (recorded["evidence"]["note"], recorded["evidence"]["plan_hash"]) == (
        "checked the ticket with the customer", proposed["plan_hash"])
    page.context.close()


def test_two_approvers_release_a_point_of_no_return_and_one_cannot_approve_twice(
        auth: Authority, approvers_console: Console, browser: Any) -> None:  # noqa: F811
    env = proposed_purge(auth)
    alice = log_in(browser, approvers_console, "apr-alice")
    alice.goto("/proposals")
    row = alice.locator(f"#proposals tr[data-action='{env.action_id}']")
    assert "point of no return — compensation not available" in row.inner_text()
    said = approve_in_page(alice, env.action_id, covers=True)
    assert said == f"{env.action_id} approved by alice@example.com (1 of 2), waiting for another approver"
    assert alice.inner_text("#approvals-count") == "1 of 2, waiting for another approver"
    assert alice.locator("#irreversible").count() == 1
    shot(alice, "proposal-one-of-two")
    assert auth.stack.action(env.action_id).status == ActionStatus.proposed
    assert auth.stack.witness.count(key=env.idempotency_key) == 0
    # The same approver again: refused, with the reason, and nothing more recorded.
    again = approve_in_page(alice, env.action_id, covers=True)
    assert again.startswith(f"proposal_refused: alice@example.com already approved {env.action_id}")
    assert evidence_of(auth.stack, env.action_id, "approval_recorded")[-1]["approvers"] == ["alice@example.com"]
    alice.context.close()
    bob = log_in(browser, approvers_console, "apr-bob")
    said = approve_in_page(bob, env.action_id, covers=True)
    assert said == f"{env.action_id} approved by bob@example.com (2 of 2): sent to the workers"
    authority = ran_once(auth, env)
    assert authority["approvals"]["approvers"] == ["alice@example.com", "bob@example.com"]
    assert authority["point_of_no_return"] == {"declared_by": "contract", "compensation": "not available"}
    bob.context.close()


def test_an_approver_denies_a_proposal_with_a_reason(auth: Authority, approvers_console: Console,  # noqa: F811
                                                     browser: Any) -> None:
    env = proposed_close(auth)
    page = log_in(browser, approvers_console, "apr-bob")
    page.goto(f"/proposals/{env.action_id}")
    token = page.evaluate("() => JSON.parse(document.body.getAttribute('hx-headers'))['X-CSRF-Token']")
    blank = page.request.post(f"/proposals/{env.action_id}/deny", form={"csrf_token": token, "reason": " "})
    assert "console_input_invalid: say why" in blank.text()
    assert auth.stack.action(env.action_id).status == ActionStatus.proposed
    page.fill("#deny-form input[name=reason]", "not during the freeze")
    page.click("#deny-form button")
    page.wait_for_selector("#message")
    assert page.inner_text("#message") == f"{env.action_id} denied by apr-bob: it closes as not started"
    assert page.locator("#approve-form, #deny-form").count() == 0
    row = auth.stack.action(env.action_id)
    assert (row.status, row.outcome, row.reason_code) == (ActionStatus.closed, Outcome.not_started, "proposal_denied")
    [denied] = evidence_of(auth.stack, env.action_id, "proposal_denied")
    assert denied == {"by": "apr-bob", "reason": "not during the freeze"}
    assert auth.stack.witness.count(key=env.idempotency_key) == 0
    page.context.close()


def test_a_viewer_an_operator_and_a_forged_approval_are_refused(auth: Authority, approvers_console: Console,  # noqa: F811
                                                browser: Any) -> None:
    env = proposed_close(auth)
    for user, role in (("viewer-dan", "a viewer"), ("ops-carol", "an operator")):
        page = log_in(browser, approvers_console, user)
        page.goto(f"/actions/{env.action_id}")
        page.click("#proposal-link a")
        page.wait_for_url(f"**/proposals/{env.action_id}")
        assert page.locator("#approve-form").count() == 0
        assert "only an approver user" in page.inner_text("#not-approver")
        token = page.evaluate("() => JSON.parse(document.body.getAttribute('hx-headers'))['X-CSRF-Token']")
        posted = page.request.post(f"/proposals/{env.action_id}/approve", form={"csrf_token": token})
        assert posted.status == 403
        assert f"console_forbidden</code>: {user} is {role}: only an approver may do this" in posted.text()
        page.goto("/approvals")
        assert page.locator("#revoke-approval-form").count() == (1 if user == "ops-carol" else 0)
        page.context.close()
    # An approver's session, but an approval posted without its CSRF token (as another site would).
    approver = log_in(browser, approvers_console, "apr-alice")
    forged = approver.request.post(f"/proposals/{env.action_id}/approve", form={"note": "from elsewhere"})
    assert forged.status == 403 and "csrf_refused" in forged.text()
    approver.context.close()
    assert evidence_of(auth.stack, env.action_id, "approval_recorded") == []
    assert auth.stack.action(env.action_id).status == ActionStatus.proposed
    # An operator may still stop it: deny is open to operators.
    operator = log_in(browser, approvers_console, "ops-carol")
    operator.goto(f"/proposals/{env.action_id}")
    operator.fill("#deny-form input[name=reason]", "cleaning up")
    operator.click("#deny-form button")
    operator.wait_for_selector("#message")
    assert auth.stack.action(env.action_id).reason_code == "proposal_denied"
    operator.context.close()


def test_the_list_the_policy_and_a_revoked_approval(auth: Authority, approvers_console: Console,  # noqa: F811
                                                    browser: Any) -> None:
    first = proposed_purge(auth)
    second = proposed_purge(auth)
    auth.approve(first.action_id, auth.alice, covers_irreversible=True)
    # Bounded autonomy: a ticket for the CFO is outside the bounds and becomes a proposal with the reason.
    auth.policy(**TWO_PERSON, **{"ticket.create": {"mode": "autonomous", "bounds": {
        "conditions": ["args.owner == 'ops'"], "max_actions_per_tenant": 1000}}})
    outside = auth.stack.envelope("ticket.create", arguments={"tenant": "acme", "title": f"t-{uid()}", "owner": "cfo"},
                                  target={"type": "ticket_queue", "id": "acme-ops"})
    auth.stack.publish(outside)
    wait_status(auth.stack, outside.action_id, ActionStatus.proposed)
    why = evidence_of(auth.stack, outside.action_id, "proposed")[0]["outside_bounds"]
    page = log_in(browser, approvers_console, "apr-bob")
    page.goto("/proposals")
    listed = page.locator("#proposals tbody tr").evaluate_all("rows => rows.map(r => r.dataset.action)")
    assert listed.index(first.action_id) < listed.index(second.action_id) < listed.index(outside.action_id)
    assert page.locator(f"#proposals tr[data-action='{first.action_id}'] .count").inner_text() == "1 of 2"
    shown = page.locator(f"#proposals tr[data-action='{outside.action_id}']")
    assert shown.locator(".bounds").inner_text() == f"outside autonomy bounds: {why}"
    assert shown.locator(".count").inner_text() == "0 of 1" and shown.locator(".irreversible").count() == 0
    shot(page, "proposals")
    # The policy in force, as the workers verify it.
    page.goto("/authority")
    signed = json.loads(auth.policy_file.read_text())
    assert page.inner_text("#policy-hash") == sha256_hex(signed["policy"])
    assert page.inner_text("#policy-version") == str(signed["policy"]["version"])
    assert page.inner_text("#signed-by").startswith("alice@example.com")
    purge = page.locator("#rules tr[data-type='ticket.purge']")
    assert (purge.locator(".mode").inner_text(), purge.locator(".required").inner_text()) == ("propose", "2")
    bounded = page.locator("#rules tr[data-type='ticket.create']")
    assert bounded.locator(".mode").inner_text() == "autonomous"
    assert "at most 1000 per tenant" in bounded.inner_text() and "args.owner == 'ops'" in bounded.inner_text()
    shot(page, "authority")
    # Revoke alice's approval from the Approvals page: listed, on the proposal, and in its own chain.
    [approval_id] = [a["approval_id"] for a in evidence_of(auth.stack, first.action_id, "approval_recorded")]
    page.goto("/approvals")
    assert page.locator(f"#recorded tr[data-approval='{approval_id}']").count() == 1
    page.fill("#revoke-approval-form input[name=approval_id]", approval_id)
    page.fill("#revoke-approval-form input[name=reason]", "approved the wrong ticket")
    page.click("#revoke-approval-form button")
    page.wait_for_selector("#message")
    assert page.inner_text("#message") == f"approval {approval_id} revoked"
    revoked = page.locator(f"#revoked tr[data-approval='{approval_id}']").inner_text()
    assert first.action_id in revoked and "apr-bob" in revoked and "approved the wrong ticket" in revoked
    shot(page, "approvals")
    page.goto(f"/proposals/{first.action_id}")
    assert "revoked by apr-bob" in page.locator("#approvals tr[data-approver='alice@example.com']").inner_text()
    [event] = auth.stack.timeline(f"approval:{approval_id}")
    assert (event["event"], event["actor"]) == ("approval_revoked", "apr-bob")
    page.context.close()


def test_a_plan_that_changed_after_approval_is_shown_against_the_approved_one(
        auth: Authority, approvers_console: Console, browser: Any) -> None:  # noqa: F811
    env = proposed_close(auth)
    approved = evidence_of(auth.stack, env.action_id, "proposed")[0]
    # The ticket changes behind the approver's back: the worker prepares another plan and refuses it.
    sor.bump_version(auth.stack.sor_db, "ticket", env.target.id)
    auth.approve(env.action_id, auth.alice)
    row = auth.stack.wait_settled(env.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "plan_changed")
    [refused] = [e for e in evidence_of(auth.stack, env.action_id, "revalidation_failed") if "content" in e]
    page = log_in(browser, approvers_console, "apr-bob")
    page.goto(f"/proposals/{env.action_id}")
    between = page.inner_text("#diff-between")
    assert approved["plan_hash"][:16] in between and refused["plan_hash"][:16] in between
    assert "plan_changed" in between
    shown = page.locator("#diff tbody tr").evaluate_all("rows => rows.map(r => r.cells[0].innerText)")
    assert shown == [c["path"] for c in plan_diff(approved["content"], refused["content"])]
    assert "target_version" in shown  # the version the approver reviewed is not the one the ticket has now
    assert page.locator("#approve-form, #deny-form").count() == 0  # no longer a proposal: nothing to decide
    shot(page, "proposal-plan-changed")
    page.context.close()
