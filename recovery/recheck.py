"""The post-condition re-check task: read a verified effect again, as its contract asked.

The reconciler claims a re-check once it is due (``recovery/recheck_sweep.py``) and sends its row
id and claim attempt here. The read is the verification's own: the contract's read path through
the read identity, its evidence sources and policy, the same conditions (``worker/verification.py``,
``worker/evidence.py``). Its verdict:

- ``expected``: ``postcondition_held``; the chain goes on, or ends (``chain_ended``) with the
  re-check that leaves none of the action's open;
- ``prohibited``, ``not_reached``, ``absent`` or ``evidence_conflict``: ``postcondition_regressed``.
  In one transaction: the event, the worker's signed statement of the row it leaves, the guarded
  move ``closed -> recovery`` (outcome kept: the effect did happen, and was verified once; finding
  and reason ``postcondition_regressed`` are the re-check's), the action's later re-checks
  cancelled; then recovery is sent the action, as after a failed verification. A read showing the
  effect gone is recorded on the row as ``not_reached`` (``read_finding`` keeps ``absent``): an
  effect that was made and undone by someone else is never retried with the same key;
- ``unavailable`` (the read path or a source could not be read): ``postcondition_unreadable``: no
  evidence either way, never a regression and never a confirmation.

A claim the reconciler took again (this worker was too slow, or thought dead) wins: this reading is
kept as ``recheck_superseded`` and changes nothing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ledger import rechecks, store
from ledger.redact import current_redactor, for_envelope
from ledger.states import ActionStatus, Outcome, RecheckStatus, VerificationFinding
from proofline.canonical import sha256_hex
from proofline.envelope import Envelope
from proofline.errors import TransitionRefused
from proofline.telemetry import context as telemetry_context
from recovery.verify import verdict_evidence
from worker import sandbox_events
from worker.dispatch import Dispatch
from worker.evidence import decide as decide_evidence
from worker.runtime import Runtime
from worker.verification import observe

log = logging.getLogger(__name__)

REGRESSED = "postcondition_regressed"
#: Findings of a re-read that mean the approved post-condition no longer holds.
REGRESSIONS = frozenset({VerificationFinding.prohibited, VerificationFinding.not_reached, VerificationFinding.absent,
                         VerificationFinding.evidence_conflict})
VERIFIED = (ActionStatus.closed, Outcome.completed_verified)


def status_for(finding: VerificationFinding) -> RecheckStatus:
    """What a re-read's verdict makes of its re-check."""
    if finding == VerificationFinding.expected:
        return RecheckStatus.held
    return RecheckStatus.regressed if finding in REGRESSIONS else RecheckStatus.unreadable


def row_finding(finding: VerificationFinding) -> VerificationFinding:
    """The finding a regression leaves on the action row (what recovery decides on)."""
    return VerificationFinding.not_reached if finding == VerificationFinding.absent else finding


@sandbox_events.records_audit
def recheck(rt: Runtime, check_id: int, attempt: int, dispatch: Dispatch) -> dict[str, Any]:
    """Run one claimed re-check (``attempt``: the claim it was sent under)."""
    actor = rt.settings.worker_id
    with store.transaction(rt.conn) as cur:
        check = rechecks.get_txn(cur, check_id)
        if check is None or check.status != RecheckStatus.claimed or check.attempts != attempt:
            return {"status": "skipped", "recheck": check_id, "current": check.status.value if check else None}
        action = store.get_action(cur, check.action_id)
        if action is None or (action.status, action.outcome) != VERIFIED:
            # The action left its verified state (a run unwound it, an operator resolved it): nothing to re-check.
            _cancel_txn(cur, check, attempt, actor, action)
            return {"status": "cancelled", "recheck": check_id, "action_id": check.action_id}
    envelope = Envelope.model_validate(action.signed_envelope)
    contract = rt.contract(envelope.action_type)
    doc = envelope.model_dump(mode="json")
    red = for_envelope(doc, contract.sensitive_fields)
    current_redactor.set(red)
    telemetry_context.bind(action.action_id, run_id=action.run_id, tenant=action.tenant,
                           action_type=action.action_type, irreversible=envelope.irreversible, stage="recheck")
    base = {"envelope": doc, "args": doc["arguments"], "target": doc["target"],
            "before": action.recovery_data.get("before") or {}, "result": (action.result or {}).get("values") or {}}
    rt.mcp.action_id = action.action_id  # the sandbox audit of these reads is this action's
    began = time.monotonic()
    obs = observe(rt, envelope, contract, base)
    verdict, readings = decide_evidence(rt, contract, obs, envelope.server.name, time.monotonic() - began, base,
                                        contract.verification.max_duration_seconds - (time.monotonic() - began))
    read = verdict.finding
    status = status_for(read)
    record = {"recheck": check.seq, "of": check.of, "recheck_key": check.recheck_key, "attempt": attempt,
              "offset_seconds": check.offset_ms / 1000, "finding": read.value, "reads": obs.reads,
              "failed_reads": obs.failed_reads, "last_error": obs.last_error, "timeline": obs.kept,
              "read_tool": contract.verification_read.tool, "identity": "read",
              "after_digest": sha256_hex(obs.after) if obs.after is not None else None,
              "read_seconds": round(time.monotonic() - began, 3)}
    if contract.verification.sources:
        record["evidence"] = verdict.summary
    events = [("evidence_read", r) for r in readings if contract.verification.all_sources]
    try:
        with store.transaction(rt.conn) as cur:
            locked = rechecks.get_txn(cur, check_id, lock=True)
            cur.execute("SELECT 1 FROM actions WHERE action_id = %s FOR UPDATE", (check.action_id,))
            now = store.get_action(cur, check.action_id)
            if locked is None or now is None or (now.status, now.outcome) != VERIFIED:
                _cancel_txn(cur, check, attempt, actor, now)
                return {"status": "cancelled", "recheck": check_id, "action_id": check.action_id}
            if status != RecheckStatus.regressed:
                rechecks.finish_txn(cur, check_id, attempt, status, read.value)
                name = "postcondition_held" if status == RecheckStatus.held else "postcondition_unreadable"
                # The chain ends with the re-check that leaves none of its action's open.
                left = rechecks.open_count_txn(cur, check.action_id)
                store.append_events_txn(cur, check.action_id, actor,
                                        [*events, (name, {**record, "open_after": left, "chain_ended": left == 0})], red)
            else:
                _regress_txn(cur, rt, now, check, attempt, obs, read, record, events, red)
    except TransitionRefused:
        with store.transaction(rt.conn) as cur:
            store.append_event_txn(cur, check.action_id, "recheck_superseded", actor, record, red)
        return {"status": "superseded", "recheck": check_id, "action_id": check.action_id}
    log.log(logging.WARNING if status == RecheckStatus.regressed else logging.INFO, "post-condition re-checked",
            extra={"event": "postcondition_rechecked", "action_id": check.action_id, "recheck": check.seq,
                   "finding": read.value, "result": status.value})
    if status == RecheckStatus.regressed:
        dispatch.recover(check.action_id)
    return {"status": status.value, "recheck": check_id, "action_id": check.action_id, "finding": read.value}


def _regress_txn(cur: store.Cursor, rt: Runtime, action: store.ActionRow, check: rechecks.Check, attempt: int,
                 obs: Any, read: VerificationFinding, record: dict[str, Any], events: list[tuple[str, dict[str, Any]]],
                 red: Any) -> None:
    """The regression: its event, the row handed to recovery with its signed statement, later re-checks cancelled."""
    actor = rt.settings.worker_id
    finding = row_finding(read)
    rechecks.finish_txn(cur, check.id, attempt, RecheckStatus.regressed, read.value)
    cancelled = rechecks.cancel_open_txn(cur, check.action_id)
    events = [*events, (REGRESSED, {**record, "read_finding": read.value, "finding": finding.value,
                                    "after": obs.after, "prior_outcome": Outcome.completed_verified.value})]
    if cancelled:
        events.append(("rechecks_cancelled", {"rechecks": cancelled, "reason": REGRESSED}))
    obs.finding = finding
    # The worker's signed statement of the row this commit leaves, so recovery accepts it.
    events.append(verdict_evidence(rt, action, red, ActionStatus.recovery, Outcome.completed_verified, obs, REGRESSED,
                                   None))
    events.append(("handed_to_recovery", {"status": ActionStatus.recovery.value,
                                          "outcome": Outcome.completed_verified.value, "reason_code": REGRESSED}))
    store.transition_txn(cur, check.action_id, [ActionStatus.closed], ActionStatus.recovery, finding=finding.value,
                         reason_code=REGRESSED, recovery_data={"after": obs.after} if obs.after is not None else None,
                         redactor=red, events=events, actor=actor)


def _cancel_txn(cur: store.Cursor, check: rechecks.Check, attempt: int, actor: str,
                action: store.ActionRow | None) -> None:
    rechecks.finish_txn(cur, check.id, attempt, RecheckStatus.cancelled, None)
    others = rechecks.cancel_open_txn(cur, check.action_id)
    store.append_event_txn(cur, check.action_id, "rechecks_cancelled", actor, {
        "rechecks": sorted({check.seq, *others}), "reason": "action_not_verified",
        "status": action.status.value if action else None,
        "outcome": action.outcome.value if action and action.outcome else None})

