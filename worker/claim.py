"""The idempotency claim, in the lease's transaction: claim the record for a first delivery, or
decide from the record that exists what a redelivery does (call again, wait, re-enqueue
verification, reconcile, refuse), and record the pre-call evidence with it."""

from __future__ import annotations

from typing import Any

from ledger import store
from ledger.redact import Redactor
from ledger.states import ActionStatus, IdempotencyStatus, Outcome
from proofline.envelope import Envelope
from proofline.errors import AuthorityBudgetExceeded, IdempotencyConflict, ReplayWindowExpired
from worker.mcp_tasks import pending_task_txn


def claim_txn(cur, envelope: Envelope, redact: Redactor, events: list, failures: list[dict[str, str]],
               before: dict[str, Any], token: int, actor: str, replay_window: float,
               admitted: dict[str, Any] | None = None, read: dict[str, Any] | None = None) -> str:
    """Claim the idempotency record (or dispatch on the one that exists) and record the pre-call
    evidence, all in the lease's transaction. Returns "call", "not_started" or a dispatch decision.
    ``read`` names the target read's MCP request (worker/request_ids.py), recorded with its evidence."""
    seen = {"target_read": read} if read else {}
    aid = envelope.action_id
    if failures:
        record = store.get_idempotency_txn(cur, envelope.idempotency_key)
        if record is None:
            # A failed precondition ends the action unstarted; it is never adapted to the new state.
            events.append(("preconditions_failed", {"failures": failures, "before": before, **seen}))
            store.transition_txn(cur, aid, [ActionStatus.published], ActionStatus.closed, outcome=Outcome.not_started,
                                 reason_code=failures[0]["reason"], recovery_data={"before": before},
                                 redactor=redact, events=events, actor=actor)
            return "not_started"
        if record.status == IdempotencyStatus.failed and not record.expired and \
                record.argument_hash == envelope.arguments_hash:
            # A retry whose preconditions no longer hold. The target changed since the failed
            # attempt: perhaps by someone else, perhaps by that attempt's own late effect. Never
            # call on a changed target; let verification tell which it is.
            events.append(("preconditions_failed", {"failures": failures, "before": before, "on": "retry", **seen}))
            store.transition_txn(cur, aid, [ActionStatus.published], ActionStatus.verifying,
                                 reason_code="retry_preconditions_failed",
                                 recovery_data={"before": before, "retry_blocked_by": failures[0]["reason"]},
                                 redactor=redact, events=events, actor=actor)
            return "reconcile"
        claimed = False  # the read reflects our own earlier effect: dispatch on the record instead
    else:
        claimed, record = store.claim_idempotency_txn(
            cur, key=envelope.idempotency_key, action_id=aid, tenant=envelope.tenant,
            argument_hash=envelope.arguments_hash, contract_hash=envelope.tool.contract_hash,
            fencing_token=token, replay_window_seconds=replay_window)
    if not claimed:
        decision = _dispatch_existing(cur, envelope, record, token, events, actor)
        if decision != "retry":
            store.append_events_txn(cur, aid, actor, events, redact)
            _finish_dispatch(cur, aid, decision, record)
            return decision
        if failures:
            # Only a resumed MCP Task gets here with failed preconditions: its own job may have
            # changed the target already. Nothing is sent again; the task is polled.
            events.append(("preconditions_failed", {"failures": failures, "before": before, "on": "task_resume",
                                                    **seen}))
        else:
            events.append(_preconditions_passed(envelope, before, read))
    else:
        events.extend(claimed_events(envelope, before, token, read))
    # The pre-call evidence and the move to executing: one round trip.
    store.transition_txn(cur, aid, [ActionStatus.published, ActionStatus.executing], ActionStatus.executing,
                         recovery_data={"before": before, **(admitted or {})}, redactor=redact, events=events,
                         actor=actor)
    return "call"


def claimed_events(envelope: Envelope, before: dict[str, Any], token: int,
                   read: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The evidence of a fresh claim: the record claimed under this token, the preconditions passed."""
    return [("idempotency_claimed", {"key": envelope.idempotency_key, "fencing_token": token}),
            _preconditions_passed(envelope, before, read)]


def _preconditions_passed(envelope: Envelope, before: dict[str, Any],
                          read: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    evidence = {"before": before} if envelope.evidence.record_precondition_snapshot else {}
    return "preconditions_passed", {**evidence, **({"target_read": read} if read else {})}


def _dispatch_existing(cur, envelope: Envelope, record: store.IdempotencyRecord, token: int, events: list,
                       actor: str) -> str:
    """Decide what a delivery does when the key already has a record (claim-first, then dispatch)."""
    key = envelope.idempotency_key
    if record.argument_hash != envelope.arguments_hash or record.contract_hash != envelope.tool.contract_hash:
        exc = IdempotencyConflict("key reused with a different argument or contract hash", idempotency_key=key)
        events.append(("idempotency_conflict", {**exc.as_evidence(), "recorded_argument_hash": record.argument_hash,
                                                "recorded_contract_hash": record.contract_hash}))
        return "conflict"
    if record.expired:
        events.append(("replay_window_expired", ReplayWindowExpired(f"record for {key} is past its window").as_evidence()))
        return "refused"
    if record.status == IdempotencyStatus.completed:
        events.append(("duplicate_suppressed", {"key": key, "recorded_result": record.result}))
        return "duplicate_suppressed"
    if record.status == IdempotencyStatus.failed and record.attempts >= envelope.authority_budget.max_calls:
        # Every call the approval allowed has been made: no further attempt, whoever asks for it.
        events.append(("authority_budget_exhausted", AuthorityBudgetExceeded(
            f"{record.attempts} calls made; the budget is {envelope.authority_budget.max_calls}",
            scope="calls").as_evidence()))
        return "budget_exhausted"
    if record.status == IdempotencyStatus.failed:
        # Proven to have made no side effect: a retry may claim it again, with the same key.
        store.update_idempotency_txn(cur, key, fencing_token=record.fencing_token, allowed=[IdempotencyStatus.failed],
                                     status=IdempotencyStatus.in_progress, new_token=token, count_attempt=True)
        events.append(("idempotency_reclaimed", {"key": key, "attempt": record.attempts + 1, "fencing_token": token}))
        return "retry"
    task = pending_task_txn(cur, envelope.action_id) if record.status == IdempotencyStatus.in_progress else None
    if task is not None:
        # The holder that is gone had created an MCP Task: poll that task again (worker/mcp_tasks.py),
        # never send a second tools/call.
        store.update_idempotency_txn(cur, key, fencing_token=record.fencing_token, allowed=[IdempotencyStatus.in_progress],
                                     status=IdempotencyStatus.in_progress, new_token=token)
        events.append(("mcp_task_resume_claimed", {"key": key, "task_id": task.get("task_id"),
                                                   "previous_fencing_token": record.fencing_token,
                                                   "fencing_token": token}))
        return "retry"
    # in_progress under a holder that is gone (we hold its lock), or already unknown: never call
    # again before the downstream state is reconciled.
    store.update_idempotency_txn(cur, key, fencing_token=record.fencing_token,
                                 allowed=[IdempotencyStatus.in_progress, IdempotencyStatus.unknown],
                                 status=IdempotencyStatus.unknown, new_token=token)
    events.append(("reconcile_required", {"key": key, "record_status": record.status.value,
                                          "previous_fencing_token": record.fencing_token, "fencing_token": token}))
    return "reconcile"


def _finish_dispatch(cur, action_id: str, decision: str, record: store.IdempotencyRecord) -> None:
    if decision == "refused" and record.status in (IdempotencyStatus.in_progress, IdempotencyStatus.unknown):
        # Past the replay window the record cannot vouch for anything: an effect may or may not
        # exist, and guessing either way is unsafe. An operator decides, with the evidence.
        cur.execute("SELECT status FROM actions WHERE action_id = %s", (action_id,))
        row = cur.fetchone()
        if row is not None and row["status"] in ("published", "executing", "verifying"):
            store.transition_txn(cur, action_id, [ActionStatus.published, ActionStatus.executing,
                                                  ActionStatus.verifying], ActionStatus.escalated,
                                 outcome=Outcome.unknown_outcome, reason_code="replay_window_expired")
        return
    if decision == "budget_exhausted":
        store.transition_txn(cur, action_id, [ActionStatus.published], ActionStatus.closed,
                             outcome=Outcome.failed_before_side_effect, reason_code=AuthorityBudgetExceeded.code)
        return
    if decision == "reconcile":
        store.transition_txn(cur, action_id, [ActionStatus.published, ActionStatus.executing, ActionStatus.verifying],
                             ActionStatus.verifying, outcome=Outcome.unknown_outcome, reason_code="reconcile_required")
