"""Operator writes through the console, in a real browser against the real stack: resolving and
retrying escalated actions (each recorded in the ledger with who and why), a kill switch that stops
the next action of its type, and the refusals: a viewer's write, a write without the CSRF token, a
write with no session at all."""

from __future__ import annotations

import uuid
from typing import Any

from ledger.states import ActionStatus, Outcome
from proofline.console.reads import ENDS_SHOWN, LANE_ENDS, LONG_LANES, LONG_TIMELINE
from proofline_kit.sor import store as sor
from recovery.operator import list_switches
from tests.conftest import Stack, wait_for
from tests.console.conftest import Console, log_in, shot
from tests.helpers import new_account, refund_env


def _escalated(stack: Stack) -> str:
    """A ticket the server says it created but did not: verification finds nothing and, with one
    attempt allowed, recovery escalates it (effect proven absent)."""
    tenant = f"c{uuid.uuid4().hex[:8]}"
    sor.set_fault(stack.sor_db, "create_ticket", "lie", remaining=1)
    envelope = stack.envelope("ticket.create", tenant=tenant, target={"type": "ticket_queue", "id": f"{tenant}-ops"},
                              arguments={"tenant": tenant, "title": f"console {uuid.uuid4().hex[:6]}", "owner": "ops"},
                              retry_policy={"max_attempts": 1, "backoff_seconds": 0.1})
    stack.publish(envelope)
    row = stack.wait_settled(envelope.action_id)
    assert (row.status, row.finding) == (ActionStatus.escalated, "absent"), row
    return envelope.action_id


def test_an_operator_resolves_an_escalated_action_and_the_ledger_records_it(stack: Stack, console: Console,
                                                                              browser: Any) -> None:
    action_id = _escalated(stack)
    page = log_in(browser, console, "ops-alice")
    page.goto("/escalations")
    assert page.locator(f"#queue tr[data-action='{action_id}']").count() == 1
    page.click(f"#queue a[href='/actions/{action_id}']")
    page.wait_for_selector("#resolve-form")
    shot(page, "action-escalated")
    page.select_option("#resolve-form select[name=resolution]", "no_effect")
    page.fill("#resolve-form input[name=reason]", "checked the queue: no ticket was created")
    page.fill("#resolve-form input[name=evidence]", '{"checked": "ticket queue", "found": 0}')
    page.click("#resolve-form button")
    page.wait_for_selector("#message")
    assert page.inner_text("#message") == f"{action_id} resolved as no_effect"
    assert page.inner_text("#outcome") == "failed_before_side_effect"
    # Shown as the operator's word, not as a verified outcome.
    assert page.inner_text("#resolution") == "resolved by operator ops-alice: no_effect"
    assert "not verified by Proofline (its finding: absent)" in page.inner_text("#status")
    shown = page.locator(".operator-event[data-event='operator_intervention']").inner_text()
    assert "by ops-alice" in shown and "no ticket was created" in shown
    assert page.locator("#timeline tr[data-event='operator_intervention']").count() == 1
    shot(page, "action-resolved")
    # The ledger, read apart from the console: who, why, what was checked, in the action's chain.
    [event] = [e for e in stack.timeline(action_id) if e["event"] == "operator_intervention"]
    assert event["actor"] == "ops-alice"
    assert event["evidence"] == {"resolution": "no_effect", "reason": "checked the queue: no ticket was created",
                                 "evidence": {"checked": "ticket queue", "found": 0}}
    row = stack.action(action_id)
    assert (row.status, row.reason_code) == (ActionStatus.closed, "operator_no_effect")
    page.goto("/escalations")
    assert page.locator(f"#queue tr[data-action='{action_id}']").count() == 0
    page.goto(f"/actions?tenant={row.tenant}")
    assert page.inner_text(f"tr[data-action='{action_id}'] .resolved") == "operator: no_effect"
    page.context.close()


def test_an_operator_retries_an_action_whose_effect_is_proven_absent(stack: Stack, console: Console,
                                                                     browser: Any) -> None:
    action_id = _escalated(stack)
    page = log_in(browser, console, "ops-alice")
    page.goto(f"/actions/{action_id}")
    page.fill("#retry-form input[name=reason]", "the server is fixed")
    page.click("#retry-form button")
    page.wait_for_selector("#message")
    assert "sent again" in page.inner_text("#message")
    final = wait_for(lambda: (r := stack.action(action_id)) and r.status == ActionStatus.closed and r, 40,
                     what=f"{action_id} to be verified after the retry")
    assert final.outcome == Outcome.completed_verified
    assert stack.effects(final.idempotency_key) == 1
    [retry] = [e for e in stack.timeline(action_id) if e["event"] == "manual_retry"]
    assert retry["actor"] == "ops-alice" and retry["evidence"]["reason"] == "the server is fixed"
    # A second retry is refused with the CLI's reason code: the action is no longer escalated.
    page.goto(f"/actions/{action_id}")
    assert page.locator("#retry-form").count() == 0
    page.context.close()


def test_a_kill_switch_set_in_the_console_stops_the_next_action_of_that_type(stack: Stack, console: Console,
                                                                             browser: Any) -> None:
    page = log_in(browser, console, "ops-alice")
    page.goto("/switches")
    # A switch that would block nothing is refused with the CLI's check and reason.
    page.select_option("#switch-form select[name=scope]", "action_type")
    page.fill("#switch-form input[name=value]", "ticket.crate")
    page.fill("#switch-form input[name=reason]", "typo")
    page.click("#switch-form button")
    page.wait_for_selector("#error")
    assert page.inner_text("#error").startswith("kill_switch_invalid: no action type 'ticket.crate'")
    assert list_switches(stack.operator) == []
    page.select_option("#switch-form select[name=scope]", "action_type")
    page.fill("#switch-form input[name=value]", "ticket.close")
    page.fill("#switch-form input[name=reason]", "closing the wrong tickets")
    page.click("#switch-form button")
    page.wait_for_selector("#message")
    assert page.inner_text("#message") == "kill switch action_type:ticket.close set"
    assert page.locator("#switches tr[data-switch='action_type:ticket.close']").count() == 1
    shot(page, "switch-set")
    assert stack.events("killswitch:action_type:ticket.close")[-1] == "kill_switch_set"
    # The next ticket.close is not started; the kill switch is the recorded reason.
    ticket = sor.put_ticket(stack.sor_db, "acme", "to close", "ops")
    version = sor.get_ticket(stack.sor_db, ticket)["ticket"]["version"]
    envelope = stack.envelope("ticket.close", arguments={"ticket_id": ticket, "expected_version": version},
                              target={"type": "ticket", "id": ticket, "expected_version": version})
    stack.publish(envelope)
    row = stack.wait_settled(envelope.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "kill_switch_engaged")
    assert stack.effects(envelope.idempotency_key) == 0
    page.goto(f"/actions/{envelope.action_id}")
    assert page.inner_text("#outcome") == "not_started" and "kill_switch_engaged" in page.inner_text("#status")
    # Cleared from the console, with who and why in the switch's chain.
    page.goto("/switches")
    clear = page.locator("#switches tr[data-switch='action_type:ticket.close'] form")
    clear.locator("input[name=reason]").fill("fixed")
    clear.locator("button").click()
    page.wait_for_selector("#message")
    assert page.inner_text("#message") == "kill switch action_type:ticket.close cleared"
    assert list_switches(stack.operator) == []
    cleared = stack.timeline("killswitch:action_type:ticket.close")[-1]
    assert (cleared["event"], cleared["actor"], cleared["evidence"]["reason"]) == ("kill_switch_cleared", "ops-alice",
                                                                                 "fixed")
    page.context.close()


def test_a_viewer_and_a_forged_write_are_refused(stack: Stack, console: Console, browser: Any) -> None:
    action_id = _escalated(stack)
    viewer = log_in(browser, console, "viewer-bob")
    viewer.goto(f"/actions/{action_id}")
    assert viewer.locator("#resolve-form").count() == 0  # no forms for a viewer
    # The set form is on the page for everyone; a viewer who sends it is refused and nothing changes.
    viewer.goto("/switches")
    viewer.select_option("#switch-form select[name=scope]", "global")
    viewer.fill("#switch-form input[name=reason]", "viewer tries")
    viewer.click("#switch-form button")
    viewer.wait_for_selector("#refused")
    assert viewer.inner_text("#refused").startswith("console_forbidden: viewer-bob is a viewer")
    shot(viewer, "viewer-refused")
    # A viewer posting a resolution directly, with its own valid CSRF token: refused too.
    token = viewer.evaluate("() => JSON.parse(document.body.getAttribute('hx-headers'))['X-CSRF-Token']")
    posted = viewer.request.post(f"/actions/{action_id}/resolve", form={
        "csrf_token": token, "resolution": "succeeded", "reason": "viewer says so"})
    assert posted.status == 403 and "console_forbidden" in posted.text()
    viewer.context.close()
    # An operator's session, but a write without the CSRF token (as a cross-site form would send it).
    operator = log_in(browser, console, "ops-alice")
    forged = operator.request.post(f"/actions/{action_id}/resolve", form={"resolution": "succeeded", "reason": "x"})
    assert forged.status == 403 and "csrf_refused" in forged.text()
    wrong = operator.request.post("/switches/set", form={"csrf_token": "not-the-token", "scope": "global",
                                                         "reason": "x"})
    assert wrong.status == 403 and "csrf_refused" in wrong.text()
    operator.set_content(forged.text())
    shot(operator, "csrf-refused")
    operator.context.close()
    # No session at all.
    anonymous = browser.new_context(base_url=console.url, viewport={"width": 1400, "height": 700})
    login = anonymous.new_page()
    login.goto("/actions")  # sent to the login form
    assert login.url == f"{console.url}/login"
    shot(login, "login")
    nobody = anonymous.request.post("/switches/set", form={"scope": "global", "reason": "x"})
    assert nobody.status == 403 and "console_forbidden" in nobody.text()
    assert anonymous.request.get("/actions", max_redirects=0).status == 303  # to the login page
    anonymous.close()
    # Nothing any of them sent reached the ledger.
    assert list_switches(stack.operator) == []
    assert stack.action(action_id).status == ActionStatus.escalated
    assert "operator_intervention" not in stack.events(action_id)


def test_an_operator_cancels_and_revokes_with_who_and_why_in_the_ledger(stack: Stack, console: Console,
                                                                         browser: Any) -> None:
    action_id = _escalated(stack)
    page = log_in(browser, console, "ops-alice")
    page.goto(f"/actions/{action_id}")
    page.fill("#cancel-form input[name=reason]", "the customer withdrew the request")
    page.click("#cancel-form button")
    page.wait_for_selector("#message")
    assert page.inner_text("#message").startswith(f"cancellation of {action_id} requested")
    [asked] = [e for e in stack.timeline(action_id) if e["event"] == "cancel_requested"]
    assert asked["actor"] == "ops-alice" and asked["evidence"]["reason"] == "the customer withdrew the request"
    # A revocation and its lifting, each on the identity's own chain.
    identity = f"agent-{uuid.uuid4().hex[:6]}"
    page.goto("/switches")
    page.fill("#revoke-form input[name=identity]", identity)
    page.fill("#revoke-form input[name=reason]", "leaked token")
    page.click("#revoke-form button")
    page.wait_for_selector("#message")
    assert page.inner_text("#message") == f"revoked {identity}"
    assert identity in page.inner_text("#revocations")
    lift = page.locator("#revocations tr", has_text=identity).locator("form")
    lift.locator("input[name=reason]").fill("token rotated")
    lift.locator("button").click()
    page.wait_for_selector("#message")
    assert page.inner_text("#message") == f"revocation of {identity} lifted"
    chain = stack.timeline(f"revocation:{identity}")
    assert [(e["event"], e["actor"], e["evidence"]["reason"]) for e in chain] == [
        ("identity_revoked", "ops-alice", "leaked token"), ("revocation_lifted", "ops-alice", "token rotated")]
    # A write without a reason is refused with its code, and records nothing.
    page.goto("/switches")
    page.fill("#revoke-form input[name=identity]", identity)
    page.eval_on_selector("#revoke-form input[name=reason]", "el => el.removeAttribute('required')")
    page.click("#revoke-form button")
    page.wait_for_selector("#error")
    assert page.inner_text("#error").startswith("console_input_invalid: say why")
    assert len(stack.timeline(f"revocation:{identity}")) == 2
    page.context.close()


def test_a_long_timeline_folds_and_a_succeeded_resolution_stays_the_operators_word(stack: Stack, console: Console,
                                                                                    browser: Any) -> None:
    """A refund that fails before commit seven times and then lands while the verification read
    path is down: a long timeline (every attempt's events) and an escalation whose finding is
    ``unavailable``. The page folds the timeline to about a screen; an operator who resolves it as
    ``succeeded`` is shown as the operator's word, never as a plain ``completed_verified``."""
    env = refund_env(stack, new_account(stack), retry_policy={"max_attempts": 8, "backoff_seconds": 0.1},
                     authority_budget={"max_calls": 8, "max_amount_cents": 5000})
    sor.set_fault(stack.sor_db, "issue_refund", "fail_before_commit", remaining=7)
    sor.set_read_outage(stack.sor_db, True, role="reader")
    try:
        stack.publish(env)
        row = stack.wait_settled(env.action_id, timeout=120)
    finally:
        sor.set_read_outage(stack.sor_db, False, role="reader")
        sor.clear_faults(stack.sor_db)
    assert (row.status, row.finding) == (ActionStatus.escalated, "unavailable"), (row.outcome, row.reason_code, [e["event"] for e in stack.timeline(env.action_id)])
    seqs = [e["seq"] for e in stack.timeline(env.action_id)]
    assert len(seqs) > LONG_TIMELINE, len(seqs)
    page = log_in(browser, console, "ops-alice")
    page.goto(f"/actions/{env.action_id}")
    page.wait_for_selector("#resolve-form")
    page.select_option("#resolve-form select[name=resolution]", "succeeded")
    page.fill("#resolve-form input[name=reason]", "the refund is on the statement")
    page.click("#resolve-form button")
    page.wait_for_selector("#message")
    assert page.inner_text("#resolution") == "resolved by operator ops-alice: succeeded"
    status = page.inner_text("#status")
    assert "completed_verified on the operator's word, not verified by Proofline (its finding: unavailable)" in status
    assert page.locator("#status > strong#outcome").count() == 0  # never the plain, bold outcome
    # Folded: every event is on the page exactly once, most of them inside closed folds, and the
    # table is about a screen high until a fold is opened.
    timeline = page.locator("#timeline")
    shown = timeline.locator("tr[data-event] > td:first-child").all_text_contents()
    assert sorted(int(s) for s in shown) == seqs + [seqs[-1] + 1]  # and the operator's own event
    folds = timeline.locator("tr.fold > td > details")
    assert folds.count() >= 1 and all(not f.evaluate("d => d.open") for f in folds.all())
    visible = [r for r in timeline.locator("tr[data-event]").all() if r.is_visible()]
    assert len(visible) <= 2 * ENDS_SHOWN + 1 < len(shown)
    folded_height = timeline.bounding_box()["height"]
    assert folded_height < 2 * page.viewport_size["height"], folded_height
    # The rest of the page folds the same way: the stage lanes of the attempts in between, the
    # earlier precondition checks and calls (one per attempt); the latest of each stays open.
    assert page.locator("#stages > .lane").count() == 2 * LANE_ENDS
    assert page.locator("#stages details.lanes-fold .lane").count() > LONG_LANES - 2 * LANE_ENDS
    assert page.locator("#earlier-preconditions pre.precondition").count() == 7
    assert page.locator("#earlier-calls").evaluate("d => d.querySelector('summary').textContent") == \
        "7 earlier calls: 7 failed_before_side_effect"
    assert "completed_unverified" in page.inner_text("#classification")
    height = page.evaluate("document.documentElement.scrollHeight")
    assert height < 4 * page.viewport_size["height"], height
    shot(page, "action-long-timeline")
    folds.first.locator("> summary").click()
    assert timeline.bounding_box()["height"] > folded_height
    page.goto(f"/actions?tenant={row.tenant}")
    assert page.inner_text(f"tr[data-action='{env.action_id}'] .resolved") == "operator: succeeded"
    # Its run's page too: the step's outcome is the operator's word.
    page.goto(f"/runs/{row.run_id}")
    assert page.inner_text("#run-operator") == ("derived from 1 of 1 steps closed on an operator's word, not verified "
                                                "by Proofline: step 0 succeeded")
    (step,) = page.locator("#steps tbody tr").all()
    assert step.locator(".resolved").inner_text() == "operator: succeeded"
    assert "completed_verified" not in step.inner_text().replace("operator_succeeded", "")
    page.context.close()
