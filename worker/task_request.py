"""The worker's request class: what Flower is told when a Proofline task returns.

Celery sends ``task-succeeded`` whenever a task body returns, and Flower paints it green. A
Proofline task returns after it has committed what happened to the action, and that may be an
escalation, a containment, a kill switch, a failure, or a call nothing has verified yet: none of
these is a success to the person looking at Flower. So, in the worker's main process, the ``task-succeeded`` event of a task whose
line (``worker/summary.py``) names such an outcome is sent as a custom task event instead,
``task-escalated``, ``task-contained``, ``task-kill_switched`` ...; Celery's event state (and so
Flower) shows the event's name, upper-cased, as the task's state.

Only the event changes. The task still returned: the message is acknowledged as after any return,
nothing is retried, the ``task_success`` signal fires, and a result backend (none is configured:
the ledger is the record) would store the line with state SUCCESS. Raising an error instead would
have made Flower's state FAILURE, which means a defect in Celery's vocabulary, and would have run
the retry machinery on an action whose outcome is already recorded.
"""

from __future__ import annotations

import ast
from typing import Any

from celery.worker.request import Request

from worker.summary import flower_state, parse_line


def shown(result: Any) -> tuple[str, str] | None:
    """The state and the line for a ``task-succeeded`` event's ``result`` (Celery's repr of the
    return value); None when it is not a Proofline line."""
    if not isinstance(result, str) or not result.startswith(("'outcome=", '"outcome=')):
        return None
    try:
        line = ast.literal_eval(result)
    except (ValueError, SyntaxError):
        return None  # cut by Celery's repr limit: leave the event as it is
    fields = parse_line(line) if isinstance(line, str) else None
    return None if fields is None else (flower_state(fields), line)


class OutcomeRequest(Request):
    """A request whose success event carries the action's outcome as the task's state."""

    def send_event(self, type: str, **fields: Any) -> None:  # noqa: A002 - Celery's own signature
        if type == "task-succeeded":
            found = shown(fields.get("result"))
            if found is not None:
                state, fields["result"] = found
                if state != "SUCCESS":
                    type = f"task-{state.lower()}"
        super().send_event(type, **fields)
