"""Worker log lines as JSON (PROOFLINE_LOG_FORMAT=json): every line a pool process writes about
an action names it (action id, run id, tenant, stage, trace id), Celery's own task lines included, and the
``extra=`` fields Celery's format used to drop are there."""

from __future__ import annotations

import json
from typing import Any

from tests.conftest import wait_for
from tests.helpers import ticket_env
from tests.telemetry.conftest import Observed


def json_lines(observed: Observed) -> list[dict[str, Any]]:
    lines = []
    for path in observed.logs:
        for raw in path.read_text(errors="replace").splitlines():
            if raw.startswith("{"):
                lines.append(json.loads(raw))  # a line that starts as JSON must be JSON
    return lines


def test_every_line_about_an_action_names_it(observed: Observed) -> None:
    stack = observed.stack
    env = ticket_env(stack)
    stack.publish(env)
    stack.wait_settled(env.action_id)

    def about() -> list[dict[str, Any]]:
        lines = [line for line in json_lines(observed) if line.get("action_id") == env.action_id]
        # Verified in place: the execute task logs the verdict, and no verification task runs.
        verified = [x for x in lines if x["logger"] == "worker.execute" and x["message"] == "verified"]
        succeeded = [x for x in lines if x["logger"] == "celery.app.trace" and "succeeded" in x["message"]]
        return lines if verified and succeeded else []

    lines = wait_for(about, 90, what="the action's log lines")
    for line in lines:
        assert (line["run_id"], line["tenant"]) == (env.run_id, env.tenant), line
        assert line["stage"] in ("execute", "verify"), line
        assert line["task_id"] and line["task"].startswith("proofline."), line
    # The workers trace (OTEL_TRACES_EXPORTER=jsonl): each line names a trace its action's events
    # recorded. This controller does not trace, so the trace starts at the execute task; a message
    # the reconciler re-drives while the first delivery is still running (a loaded machine: one took
    # 11.8 s) runs in the trace of the sweep that sent it, one more trace per re-drive.
    timeline = stack.timeline(env.action_id)
    recorded = {e["evidence"].get("trace_id") for e in timeline} - {None}
    redriven = sum(e["event"] == "redriven" for e in timeline)
    assert 1 <= len(recorded) <= 1 + redriven, [(e["event"], e["evidence"].get("trace_id")) for e in timeline]
    assert {line.get("trace_id") for line in lines} <= recorded
    stages = {line["stage"] for line in lines}
    assert stages == {"execute"}
    verified = next(x for x in lines if x["message"] == "verified")
    assert (verified["event"], verified["finding"], verified["in_place"]) == ("verification_finished", "expected", True)
    # A pool process's lines while it handles no action carry no action's fields.
    for line in json_lines(observed):
        if line.get("action_id") is None:
            assert "run_id" not in line and "stage" not in line, line
