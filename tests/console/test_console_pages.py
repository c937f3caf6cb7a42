"""The console in a real browser against the real stack (Postgres, Celery worker, MCP server):
the list's filters, paging and live updates; one action's timeline; a run; the overview."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from typing import Any

from ledger.states import Outcome
from tests.conftest import Stack
from tests.console.conftest import Console, log_in, shot
from tests.helpers import new_account, refund_env, run_of, run_settled, stale_close_env, ticket_env


def _tenant() -> str:
    return f"c{uuid.uuid4().hex[:8]}"


def _ticket(stack: Stack, tenant: str, **kw: Any) -> str:
    envelope = stack.envelope("ticket.create", tenant=tenant, target={"type": "ticket_queue", "id": f"{tenant}-ops"},
                              arguments={"tenant": tenant, "title": f"console {uuid.uuid4().hex[:6]}", "owner": "ops"},
                              **kw)
    stack.publish(envelope)
    return envelope.action_id


def _listed(page: Any) -> list[str]:
    return page.locator("#actions-table tbody tr[data-action]").evaluate_all(
        "rows => rows.map(r => r.dataset.action)")


def test_the_list_filters_pages_and_updates_itself(stack: Stack, console: Console, browser: Any) -> None:
    tenant = _tenant()
    verified = _ticket(stack, tenant)
    expired = _ticket(stack, tenant, approval_ttl=timedelta(seconds=-1))
    assert stack.wait_settled(verified).outcome == Outcome.completed_verified
    assert stack.wait_settled(expired).outcome == Outcome.not_started
    page = log_in(browser, console, "viewer-bob")
    page.goto("/actions")
    # The filter form, as a person uses it: pick the tenant, then an outcome.
    page.select_option("select[name=tenant]", tenant)
    page.click("#filters button")
    page.wait_for_url("**tenant=*")
    assert _listed(page) == [expired, verified]  # newest first
    page.select_option("select[name=outcome]", ["completed_verified"])
    page.click("#filters button")
    page.wait_for_url("**outcome=completed_verified*")
    assert _listed(page) == [verified]
    shot(page, "actions-filtered")
    page.goto(f"/actions?tenant={tenant}&status=closed&outcome=not_started")
    assert _listed(page) == [expired]
    page.goto(f"/actions?tenant={tenant}&action_type=ticket.close")
    assert _listed(page) == [] and page.inner_text("#empty") == "no actions match these filters"
    page.goto(f"/actions?tenant={tenant}&since=2099-01-01T00:00:00")
    assert _listed(page) == []
    page.goto(f"/actions?tenant={tenant}&until=2000-01-01T00:00:00")
    assert _listed(page) == []
    # A time range that is not one is said so, with its reason code.
    answer = page.goto(f"/actions?tenant={tenant}&since=yesterday")
    assert answer.status == 400 and page.inner_text("#refused").startswith("console_input_invalid: 'yesterday'")
    # Paging: one per page, the next page through the link.
    page.goto(f"/actions?tenant={tenant}&limit=1")
    assert _listed(page) == [expired]
    page.click("#next-page")
    page.wait_for_url("**before=*")
    assert _listed(page) == [verified]
    assert page.locator("#next-page").count() == 0
    # Live: the first page polls; an action published now appears without a reload.
    page.goto(f"/actions?tenant={tenant}")
    assert _listed(page) == [expired, verified]
    newer = _ticket(stack, tenant)
    page.wait_for_selector(f"tr[data-action='{newer}']", timeout=20_000)
    assert _listed(page)[0] == newer
    shot(page, "actions-live")
    page.context.close()


def test_one_action_shows_its_stage_timeline_and_evidence(stack: Stack, console: Console, browser: Any) -> None:
    action_id = _ticket(stack, _tenant())
    row = stack.wait_settled(action_id)
    assert row.outcome == Outcome.completed_verified
    page = log_in(browser, console, "viewer-bob")
    page.goto("/actions")
    page.goto(f"/actions/{action_id}")
    shown = page.locator("#timeline tr[data-event]").evaluate_all("rows => rows.map(r => r.dataset.event)")
    assert shown == stack.events(action_id)  # every ledger event, in chain order
    for event in ("published", "lease_acquired", "preconditions_passed", "tool_called", "verification_finished",
                  "final_state"):
        assert event in shown
    stages = page.locator("#stages .stage").all_inner_texts()
    assert stages[0] == "publish" and "call" in stages and "verify" in stages and stages[-1] == "settled"
    assert page.inner_text("#outcome") == "completed_verified"
    assert "intact" in page.inner_text("#chain") and f"{len(shown)} events" in page.inner_text("#chain")
    assert "completed_unverified" in page.inner_text("#classification")
    assert "finding expected" in page.inner_text(".verification")
    assert '"before"' in page.inner_text("#preconditions")
    assert row.idempotency_key in page.inner_text("#envelope")
    # A viewer sees no operator forms.
    assert page.locator("form[action$='/cancel']").count() == 0
    shot(page, "action-verified")
    page.context.close()


def test_a_run_shows_its_steps_and_the_compensations_in_reverse(stack: Stack, console: Console,
                                                                  browser: Any) -> None:
    account = new_account(stack)
    steps = run_of(stack, [lambda **kw: ticket_env(stack, **kw), lambda **kw: refund_env(stack, account, **kw),
                           lambda **kw: stale_close_env(stack, **kw)])
    stack.publish_run(steps)
    run_settled(stack, steps[0].run_id, expect="compensated")
    page = log_in(browser, console, "viewer-bob")
    page.goto("/runs")
    page.click(f"a[href='/runs/{steps[0].run_id}']")
    page.wait_for_selector("#run-outcome")
    assert page.inner_text("#run-outcome") == "compensated"
    step_rows = page.locator("#steps tbody tr").all_inner_texts()
    assert [r.split("\t")[1] for r in step_rows] == [s.action_id for s in steps]
    assert ["compensated", "compensated", "not_started"] == [r.split("\t")[4] for r in step_rows]
    comp_rows = page.locator("#compensations tbody tr").all_inner_texts()
    parents = [r.split("\t")[3] for r in comp_rows]
    assert parents == [steps[1].action_id, steps[0].action_id]  # the later step first
    shot(page, "run-compensated")
    page.context.close()


def test_the_overview_plots_what_the_ledger_holds(stack: Stack, console: Console, browser: Any) -> None:
    assert stack.wait_settled(_ticket(stack, _tenant())).outcome == Outcome.completed_verified
    page = log_in(browser, console, "viewer-bob")
    page.goto("/?minutes=15")
    for chart in ("verified", "rates", "latency", "queue-age"):
        assert page.locator(f"#chart-{chart} svg").count() == 1
    # The time axis, in each window: a handful of real times (UTC), none cut to an ellipsis.
    for window in ("/?minutes=15", "/", "/?minutes=360"):
        page.goto(window)
        for chart in ("verified", "rates", "latency"):
            ticks = page.locator(f"#chart-{chart} svg .axis.x .guides text").all_text_contents()
            assert 2 <= len(ticks) <= 7 and all(re.fullmatch(r"(\d\d \w{3} )?\d\d:\d\d", t) for t in ticks), \
                (window, ticks)
    page.goto("/?minutes=15")
    # The verified bars: at least the one action verified a moment ago is drawn.
    assert page.locator("#chart-verified svg .bar rect").count() >= 1
    totals = page.inner_text("p.muted")
    assert int(totals.split(" verified")[0]) >= 1
    # Reads went through the reader role.
    assert "reads as proofline_reader" in page.inner_text("#roles")
    shot(page, "overview")
    page.goto("/runs")
    assert page.locator("#runs tbody tr").count() >= 1
    shot(page, "runs")
    page.goto("/escalations")
    shot(page, "escalations")
    page.goto("/switches")
    shot(page, "switches")
    page.context.close()


def test_an_evidence_conflict_shows_each_reading_side_by_side(stack: Stack, console: Console, browser: Any) -> None:
    """A system of record lying consistently about a refund: its own read says done, the audit log
    never saw it. The page shows one column per reading with the conflict marked."""
    from tests.faults.test_independent_evidence import under_fault
    from tests.helpers import evidence_of

    env = refund_env(stack, new_account(stack))
    assert under_fault(stack, "issue_refund", "lie_consistently", env).finding == "evidence_conflict"
    read = {r["source"]: r for r in evidence_of(stack, env.action_id, "evidence_read")}
    page = log_in(browser, console, "viewer-bob")
    page.goto(f"/actions/{env.action_id}")
    sources = page.locator("#readings thead th[data-source]").all_inner_texts()
    assert sorted(sources) == sorted(read) == ["audit", "primary"]
    assert "conflict" in (page.get_attribute("#readings", "class") or "")
    assert "disagree" in page.inner_text("#conflict")
    findings = page.locator("#readings tr.findings td").evaluate_all("cells => cells.map(c => c.dataset.finding)")
    assert dict(zip(sources, findings, strict=True)) == {s: read[s]["finding"] for s in sources}
    assert {"expected", "absent"} == set(findings)
    cells = {label: page.locator(f"#readings tr:has(th:text-is('{label}')) td").all_inner_texts()
             for label in ("server", "identity", "tool", "values read")}
    for i, source in enumerate(sources):
        assert cells["server"][i] == read[source]["server"] and cells["tool"][i] == read[source]["tool"]
        assert cells["identity"][i] == read[source]["identity"]
    audit_values = cells["values read"][sources.index("audit")]
    assert '"count": 0' in audit_values
    shot(page, "action-evidence-conflict")
    page.context.close()
