"""Flower's configuration for Proofline (``proofline flower`` passes it as ``--conf``).

Each Proofline task's result is one line that starts with the action's outcome and id
(``outcome=escalated action=act-7 reason=... status=escalated``: ``worker/summary.py``), and a task
whose action escalated, was contained, kill-switched, refused, failed or was left unverified ends in
a custom state (ESCALATED, CONTAINED, KILL_SWITCHED, UNVERIFIED, ...) rather than SUCCESS
(``worker/task_request.py``). So
the task list shows the result column next to the state.
"""

#: The task list's columns: Flower's defaults plus the result, where Proofline's outcome is.
tasks_columns = "name,uuid,state,result,received,runtime,worker"
