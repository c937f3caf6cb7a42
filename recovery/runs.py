"""Multi-step runs: each step runs only after the previous one is verified; when a step fails,
the later steps are aborted and the verified steps are compensated in reverse order, one at a
time, each verified. A run's outcome is derived from its steps, never stored apart from them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ledger import store
from ledger.states import ActionStatus, Outcome
from proofline.envelope import Envelope
from worker.dispatch import Dispatch

log = logging.getLogger(__name__)

DONE = (ActionStatus.closed, ActionStatus.escalated, ActionStatus.cancelled)


@dataclass(frozen=True)
class Step:
    action_id: str
    step: int
    status: ActionStatus
    outcome: Outcome | None
    reason_code: str | None
    message: dict[str, Any] | None

    @property
    def verified(self) -> bool:
        return self.status == ActionStatus.closed and self.outcome == Outcome.completed_verified

    @property
    def failed(self) -> bool:
        """This step ended the run: it settled without its effect (or was cancelled). A step
        aborted because an earlier one failed is a consequence, not a failure."""
        if self.status not in DONE or self.reason_code == "run_aborted":
            return False
        if self.status == ActionStatus.cancelled:
            return True
        return self.outcome not in (Outcome.completed_verified, Outcome.compensated)


def load_steps(cur: Any, run_id: str) -> list[Step]:
    cur.execute("""SELECT action_id, step, status, outcome, reason_code, envelope, key_id, signature, sealed_message
                   FROM actions WHERE run_id = %s AND kind = 'action' ORDER BY step""", (run_id,))
    steps = []
    for r in cur.fetchall():
        # Only a pending step's message is ever sent (released); the others are not opened.
        message = store.signed_message_of(r) if r["status"] == ActionStatus.pending.value else None
        steps.append(Step(r["action_id"], r["step"], ActionStatus(r["status"]),
                          Outcome(r["outcome"]) if r["outcome"] else None, r["reason_code"], message))
    return steps


def ended(steps: list[Step]) -> list[Step]:
    """Steps that settled without their verified effect (failed, cancelled, or undone after their own
    verification failed). The highest of them is where the run stopped; everything verified below
    it is unwound."""
    return [s for s in steps if s.status in DONE and not s.verified and s.reason_code != "run_aborted"]


def run_outcome(steps: list[Step]) -> str:
    """completed | in_progress | compensated | partially_completed | failed, from the steps alone."""
    if steps and all(s.verified for s in steps):
        return "completed"
    if any(s.status not in DONE for s in steps if s.status != ActionStatus.pending) or not ended(steps):
        return "in_progress"
    if any(s.outcome == Outcome.compensation_failed for s in steps) or any(s.verified for s in steps):
        return "partially_completed"
    if any(s.outcome == Outcome.compensated for s in steps):
        return "compensated"
    return "failed"


def on_step_settled(conn: Any, actor: str, envelope: Envelope, status: ActionStatus, outcome: Outcome | None,
                    dispatch: Dispatch) -> None:
    run_id = envelope.run_id
    release: dict[str, Any] | None = None
    compensate: str | None = None
    with store.transaction(conn) as cur:
        # One coordinator per run at a time; the steps' own transitions stay guarded as well.
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"proofline:run:{run_id}",))
        steps = load_steps(cur, run_id)
        stopped = ended(steps)
        if not stopped:
            nxt = next((s for s in steps if s.status == ActionStatus.pending), None)
            before = [s for s in steps if nxt is not None and s.step < nxt.step]
            if nxt is not None and all(s.verified for s in before):
                store.append_event_txn(cur, nxt.action_id, "released", actor,
                                       {"after_step": nxt.step - 1, "run_id": run_id})
                store.transition_txn(cur, nxt.action_id, [ActionStatus.pending], ActionStatus.published)
                release = nxt.message
            elif all(s.verified for s in steps) and len(steps) >= envelope.run_steps:
                # Only a run whose every step is recorded is complete: a step published on its own
                # (``hold=True``) may be recorded after the one before it settled. The reconciler's
                # follow-up sweep releases it then, from that earlier step.
                _record_run(cur, run_id, actor, steps)
        else:
            first = max(s.step for s in stopped)
            for s in steps:
                if s.status == ActionStatus.pending:
                    store.append_event_txn(cur, s.action_id, "run_aborted", actor,
                                           {"failed_step": first, "run_id": run_id})
                    store.transition_txn(cur, s.action_id, [ActionStatus.pending], ActionStatus.closed,
                                         outcome=Outcome.not_started, reason_code="run_aborted")
            busy = any(s.status in (ActionStatus.recovery, ActionStatus.executing, ActionStatus.verifying,
                                    ActionStatus.published) for s in steps)
            stop = any(s.outcome == Outcome.compensation_failed for s in steps)
            to_undo = [s for s in steps if s.verified and s.step < first]
            if not busy and not stop and to_undo:
                last = max(to_undo, key=lambda s: s.step)
                store.append_event_txn(cur, last.action_id, "run_compensation", actor,
                                       {"failed_step": first, "run_id": run_id, "order": "reverse"})
                store.transition_txn(cur, last.action_id, [ActionStatus.closed], ActionStatus.recovery,
                                     reason_code="run_step_failed")
                compensate = last.action_id
            elif not busy:
                _record_run(cur, run_id, actor, load_steps(cur, run_id))
    if release is not None:
        dispatch.execute(release, queue="actions")
    if compensate is not None:
        dispatch.recover(compensate)


def _record_run(cur: Any, run_id: str, actor: str, steps: list[Step]) -> None:
    cur.execute("SELECT 1 FROM ledger_events WHERE action_id = %s AND event = 'run_settled'", (f"run:{run_id}",))
    if cur.fetchone() is None:
        store.append_event_txn(cur, f"run:{run_id}", "run_settled", actor, {
            "outcome": run_outcome(steps),
            "steps": [{"action_id": s.action_id, "step": s.step, "status": s.status.value,
                       "outcome": s.outcome.value if s.outcome else None} for s in steps]})
