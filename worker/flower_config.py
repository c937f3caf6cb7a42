"""Flower's configuration for Proofline (``proofline flower`` passes it as ``--conf``).

Flower's state column is Celery's: SUCCESS means the task body returned, whatever happened to the
action. What the action's outcome is, and why, is in the task's result (``worker/summary.py``), so
the task list shows the result column, and ``format_task`` renders a Proofline summary as
``outcome / reason (status)``, e.g. ``not_started / kill_switch_engaged (closed)``.
"""

import ast

#: The task list's columns: Flower's defaults plus the result, where Proofline's outcome is.
tasks_columns = "name,uuid,state,result,received,runtime,worker"


def format_task(task):
    """Render a Proofline task summary for people; anything else is left as Flower shows it."""
    try:
        summary = ast.literal_eval(task.result) if isinstance(task.result, str) else None
    except (ValueError, SyntaxError):
        return task
    if not isinstance(summary, dict) or "status" not in summary:
        return task
    outcome = summary.get("outcome") or "-"
    reason = summary.get("reason_code") or summary.get("reason") or "-"
    task.result = f"{outcome} / {reason} ({summary['status']})"
    return task
