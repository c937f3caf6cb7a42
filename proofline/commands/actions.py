"""Reading what happened: ``actions list``, ``status`` (``--follow``), ``runs list``, ``run``,
``forensics``. All of them connect as the reader role."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import click

from ledger.states import ActionStatus, Outcome
from proofline.commands.base import MODE, connect, dash, emit, since_value, ts

#: Statuses in which an action will not move again without an operator: ``--follow`` stops there.
FOLLOW_STOPS = (ActionStatus.closed.value, ActionStatus.cancelled.value, ActionStatus.escalated.value)


@click.group("actions")
def actions() -> None:
    """List actions from the ledger."""


@actions.command("list")
@click.option("--status", "statuses", multiple=True, type=click.Choice([s.value for s in ActionStatus]),
              help="repeat for several")
@click.option("--outcome", "outcomes", multiple=True, type=click.Choice([o.value for o in Outcome]),
              help="repeat for several")
@click.option("--tenant")
@click.option("--action-type")
@click.option("--run-id")
@click.option("--since", help="published at or after: ISO timestamp, or an age (90s, 15m, 2h, 7d)")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 1000))
@click.option("--before", "before", default=None,
              help="the next page: the 'next' cursor a previous page printed")
@click.option("--follow", is_flag=True,
              help="after the page, print each matching action that appears or changes status, outcome or "
                   "reason, until Ctrl-C (or --stop-after)")
@click.option("--stop-after", type=click.FloatRange(min=0.1), default=None,
              help="with --follow: stop watching after this many seconds (exit 0)")
@click.option("--interval", type=click.FloatRange(0.05, 10.0), default=1.0, show_default=True,
              help="with --follow: how often the ledger is read")
def actions_list(statuses, outcomes, tenant, action_type, run_id, since, limit, before, follow, stop_after,
                 interval) -> None:
    """Actions newest first, with their status, outcome and reason (``--follow``: then watch for more)."""
    from ledger.listing import ActionFilter, list_actions

    if follow and (MODE.json or before):
        raise click.UsageError("--follow streams lines as actions change: not with --json or --before")
    flt = ActionFilter(status=tuple(statuses), outcome=tuple(outcomes), tenant=tenant, action_type=action_type,
                       since=since_value(since), run_id=run_id, before=_cursor(before))
    with connect("reader") as conn:
        with conn.cursor() as cur:
            rows = list_actions(cur, flt, limit + 1)
        page, more = rows[:limit], len(rows) > limit
        cursor = f"{page[-1]['published_at'].isoformat()}|{page[-1]['action_id']}" if more else None
        if not follow:
            emit({"actions": page, "next": cursor}, lambda: _actions_text(page, cursor, flt))
            return
        click.echo(_actions_text(page, None, flt))
        _watch(conn, flt, limit, page, stop_after, interval)


def _state(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["status"], row["outcome"], row["reason_code"]


def _watch(conn: Any, flt: Any, limit: int, seen_rows: list[dict[str, Any]], stop_after: float | None,
           interval: float) -> None:
    """Read the newest ``limit`` matching actions every ``interval`` and print the line of each that
    is new or whose status, outcome or reason moved. Ctrl-C ends it as a normal exit."""
    from ledger.listing import list_actions

    seen = {r["action_id"]: _state(r) for r in seen_rows}
    deadline = None if stop_after is None else time.monotonic() + stop_after
    try:
        while deadline is None or time.monotonic() < deadline:
            time.sleep(interval)
            with conn.cursor() as cur:
                rows = list_actions(cur, flt, limit)
            for row in reversed(rows):  # oldest change first, as a log reads
                if seen.get(row["action_id"]) != _state(row):
                    seen[row["action_id"]] = _state(row)
                    click.echo(_action_line(row))
    except KeyboardInterrupt:
        return


def _action_line(r: dict[str, Any]) -> str:
    return (f"{ts(r['published_at']):<27} {r['action_id']:<32} {r['action_type']:<16} {r['tenant']:<10} "
            f"{r['status']:<10} {dash(r['outcome']):<26} {dash(r['reason_code'])}")


def _cursor(text: str | None) -> tuple[datetime, str] | None:
    if not text:
        return None
    at, sep, action_id = text.partition("|")
    try:
        return datetime.fromisoformat(at), action_id
    except ValueError:
        raise click.BadParameter("a cursor printed as 'next' by the previous page", param_hint="--before") from None


def _actions_text(rows: list[dict[str, Any]], cursor: str | None, flt: Any) -> str:
    if not rows:
        narrowed = any((flt.status, flt.outcome, flt.tenant, flt.action_type, flt.since, flt.run_id, flt.before))
        return "no actions match these filters" if narrowed else "no actions in the ledger yet"
    lines = [f"{'published':<27} {'action':<32} {'type':<16} {'tenant':<10} {'status':<10} {'outcome':<26} reason"]
    lines += [_action_line(r) for r in rows]
    if cursor:
        lines.append(f"more: --before '{cursor}'")
    return "\n".join(lines)


@click.command()
@click.argument("action_id")
@click.option("--timeline/--no-timeline", default=True, help="also print the ledger events")
@click.option("--follow", is_flag=True, help="print each new ledger event until the action settles "
                                             "(closed, cancelled or escalated)")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=None,
              help="with --follow: give up after this many seconds (exit 15)")
@click.option("--interval", type=click.FloatRange(0.05, 10.0), default=0.5, show_default=True,
              help="with --follow: how often the ledger is read")
def status(action_id: str, timeline: bool, follow: bool, timeout: float | None, interval: float) -> None:
    """An action's current state and its ledger timeline (``--follow``: stream it until it settles)."""
    from proofline.errors import NotFound
    from proofline.report import action_report, render_report

    with connect("reader") as conn:
        with conn.cursor() as cur:
            report = action_report(cur, action_id)
        if report is None:
            raise NotFound(f"no action {action_id}", action_id=action_id)
        if follow:
            report = _follow(conn, report, timeline, timeout, interval)
    if follow and not MODE.json:
        click.echo(render_report(report, timeline=False))
        return
    emit(report, lambda: render_report(report, timeline=timeline))


def _follow(conn: Any, report: dict[str, Any], timeline: bool, timeout: float | None,
            interval: float) -> dict[str, Any]:
    """Poll the ledger (one indexed read per interval) and print events as they are appended."""
    from proofline.errors import FollowTimedOut
    from proofline.report import action_report, event_line

    action_id = report["action_id"]
    shown = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if not MODE.json:
            new = report["timeline"][shown:] if timeline or shown else report["timeline"][-1:]
            for ev in new:
                click.echo(event_line(ev))
            shown = len(report["timeline"])
        if report["status"] in FOLLOW_STOPS:
            return report
        if deadline is not None and time.monotonic() > deadline:
            raise FollowTimedOut(f"{action_id} is still {report['status']} after {timeout:g} s", action_id=action_id)
        time.sleep(interval)
        with conn.cursor() as cur:
            report = action_report(cur, action_id) or report


@click.group("runs")
def runs() -> None:
    """List multi-step runs."""


@runs.command("list")
@click.option("--tenant")
@click.option("--since", help="published at or after: ISO timestamp, or an age (90s, 15m, 2h, 7d)")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 500))
def runs_list(tenant: str | None, since: str | None, limit: int) -> None:
    """Runs newest first, with their steps and the outcome derived from them."""
    from ledger.listing import list_runs

    with connect("reader") as conn, conn.cursor() as cur:
        rows = list_runs(cur, tenant=tenant, since=since_value(since), limit=limit)
        for row in rows:
            row["outcome"] = _run_outcome(cur, row["run_id"])[0]
    if not rows:
        emit({"runs": []}, "no runs match these filters" if tenant or since else "no runs in the ledger yet")
        return
    emit({"runs": rows}, lambda: "\n".join(
        [f"{'published':<27} {'run':<36} {'tenant':<10} {'steps':>5}  outcome"] +
        [f"{ts(r['published_at']):<27} {r['run_id']:<36} {r['tenant']:<10} {r['steps']:>5}  {r['outcome']}"
         for r in rows]))


def _run_outcome(cur: Any, run_id: str) -> tuple[str, list[Any]]:
    """The run's outcome from its steps' rows (no signed message is opened to list them)."""
    from ledger.listing import ActionFilter, list_actions
    from recovery.runs import Step, run_outcome

    rows = sorted(list_actions(cur, ActionFilter(run_id=run_id), 1000), key=lambda r: r["step"])
    steps = [Step(r["action_id"], r["step"], ActionStatus(r["status"]), Outcome(r["outcome"]) if r["outcome"] else None,
                  r["reason_code"], None) for r in rows if r["kind"] == "action"]
    return run_outcome(steps), steps


@click.command()
@click.argument("run_id")
def run(run_id: str) -> None:
    """A multi-step run: its steps and the outcome derived from them."""
    from proofline.errors import NotFound

    with connect("reader") as conn, conn.cursor() as cur:
        outcome, steps = _run_outcome(cur, run_id)
    if not steps:
        raise NotFound(f"no run {run_id}", run_id=run_id)
    data = {"run_id": run_id, "outcome": outcome,
            "steps": [{"step": s.step, "action_id": s.action_id, "status": s.status.value,
                       "outcome": s.outcome.value if s.outcome else None, "reason_code": s.reason_code}
                      for s in steps]}
    emit(data, lambda: "\n".join([f"run {run_id}: {outcome}"] + [
        f"  step {s.step}  {s.action_id:<32} {s.status.value:<10} {dash(s.outcome):<22} {dash(s.reason_code)}"
        for s in steps]))


@click.command()
@click.argument("action_id")
def forensics(action_id: str) -> None:
    """Reconstruct an action and its recovery from the ledger alone."""
    from proofline.errors import NotFound
    from proofline.forensics import document, reconstruct

    with connect("reader") as conn, conn.cursor() as cur:
        text = reconstruct(cur, action_id)
        # --json: the structured reconstruction (chain check, authorized, checked, executed, changed,
        # recovery with nested recovery actions, final), with the text report alongside.
        doc = document(cur, action_id) if MODE.json and text is not None else None
    if text is None:
        raise NotFound(f"no ledger events for {action_id}", action_id=action_id)
    emit({**(doc or {}), "action_id": action_id, "report": text}, text)


COMMANDS = (actions, status, runs, run, forensics)
