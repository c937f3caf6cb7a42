"""Proposals and approvals, as approvers act on them: approve an exact plan, deny, revoke.

A proposal is an action the worker prepared and left ``proposed`` (authority mode ``propose``, or
an autonomous action outside its bounds), with its plan and plan hash in its ``proposed`` event.
An approver approves it with their own ``approver`` key: the statement binds the action, its intent
and that plan hash, and is stored as signed (``action_approvals``). When as many distinct approvers
as the policy requires have signed, the action goes back to ``published`` and its controller-signed
message is sent again; the worker then verifies every recorded approval against the keyring,
prepares the plan again and refuses the commit as ``plan_changed`` if it is not the approved one.

The database role these functions connect as (``proofline_operator``) can insert an approval row,
but a row is not authority: only the approver's signature is, and the worker checks it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ledger import store
from ledger.redact import scrub_text
from ledger.states import ActionStatus, Outcome
from proofline.approvals import ApprovalScope, sign_approval, statement_for, verify_one
from proofline.authority import load_policy
from proofline.errors import NotFound, ProposalRefused
from proofline.keys import KeyRole, SigningKey, load_keyring
from proofline.settings import Settings
from worker.dispatch import Dispatch
from worker.validate import authenticate_row

PROPOSALS_SQL = """
SELECT a.action_id, a.action_type, a.tenant, a.updated_at AS proposed_at, e.evidence,
       (SELECT count(*) FROM action_approvals p WHERE p.action_id = a.action_id AND NOT EXISTS
          (SELECT 1 FROM approval_revocations r WHERE r.approval_id = p.approval_id)) AS approvals
  FROM actions a
  JOIN LATERAL (SELECT evidence FROM ledger_events WHERE action_id = a.action_id AND event = 'proposed'
                 ORDER BY seq DESC LIMIT 1) e ON true
 WHERE a.status = 'proposed'
 ORDER BY a.updated_at
"""


def list_proposals(conn: Any) -> list[dict[str, Any]]:
    """Every action waiting for an approver, oldest first, with its plan evidence."""
    with conn.cursor() as cur:
        cur.execute(PROPOSALS_SQL)
        return list(cur.fetchall())


def proposal(conn: Any, action_id: str) -> dict[str, Any]:
    """One proposal: the plan it waits on and the approvals recorded so far."""
    with conn.cursor() as cur:
        action = store.get_action(cur, action_id)
        if action is None:
            raise NotFound(f"no action {action_id}", action_id=action_id)
        cur.execute("SELECT evidence FROM ledger_events WHERE action_id = %s AND event = 'proposed' "
                    "ORDER BY seq DESC LIMIT 1", (action_id,))
        row = cur.fetchone()
        cur.execute("SELECT approval_id, approver, recorded_at FROM action_approvals WHERE action_id = %s "
                    "ORDER BY recorded_at", (action_id,))
        approvals = list(cur.fetchall())
    return {"action_id": action_id, "status": action.status.value, "action_type": action.action_type,
            "tenant": action.tenant, "plan": row["evidence"] if row else None, "approvals": approvals}


def _locked_proposal(cur: Any, action_id: str) -> store.ActionRow:
    cur.execute("SELECT 1 FROM actions WHERE action_id = %s FOR UPDATE", (action_id,))
    action = store.get_action(cur, action_id)
    if action is None:
        raise NotFound(f"no action {action_id}", action_id=action_id)
    if action.status != ActionStatus.proposed:
        raise ProposalRefused(f"{action_id} is {action.status.value}, not proposed", action_id=action_id)
    return action


def approve(settings: Settings, conn: Any, dispatch: Dispatch, action_id: str, key: SigningKey, *,
            ttl: timedelta = timedelta(hours=1), covers_irreversible: bool = False,
            max_amount_cents: int | None = None, note: str = "") -> dict[str, Any]:
    """Sign an approval of the plan ``action_id`` waits on, record it, and send the action again
    once enough distinct approvers have signed. Returns what was recorded."""
    keyring = load_keyring(settings.keyring_file, settings.environment)
    entry = keyring.get(key.key_id)
    if entry is None or entry.role != KeyRole.approver or entry.revoked:
        raise ProposalRefused(f"key {key.key_id} is not an active approver key in the keyring")
    identity = entry.identity or entry.key_id
    policy = load_policy(settings.authority_file, keyring, settings.environment)
    with store.transaction(conn) as cur:
        action = _locked_proposal(cur, action_id)
        # A recovery action (a proposed compensation) is signed by recovery, anything else by a controller.
        envelope = authenticate_row(action, keyring, KeyRole.controller if action.kind == "action" else KeyRole.recovery)
        cur.execute("SELECT evidence FROM ledger_events WHERE action_id = %s AND event = 'proposed' "
                    "ORDER BY seq DESC LIMIT 1", (action_id,))
        plan = cur.fetchone()
        plan_hash = plan["evidence"].get("plan_hash") if plan else None
        if not isinstance(plan_hash, str):
            raise ProposalRefused(f"{action_id} has no recorded plan to approve", action_id=action_id)
        # A revoked approval no longer counts towards releasing the action (nor would the worker take it).
        cur.execute("SELECT approver FROM action_approvals p WHERE action_id = %s AND NOT EXISTS "
                    "(SELECT 1 FROM approval_revocations r WHERE r.approval_id = p.approval_id)", (action_id,))
        approvers = {r["approver"] for r in cur.fetchall()}
        if identity in approvers:
            raise ProposalRefused(f"{identity} already approved {action_id}; a second approval must come from "
                                  "another approver", action_id=action_id, approver=identity)
        statement = statement_for(envelope, approver=identity, ttl=ttl, plan_hash=plan_hash,
                                  scope=ApprovalScope(covers_irreversible=covers_irreversible,
                                                      max_amount_cents=max_amount_cents))
        signed = sign_approval(statement, key)
        verify_one(signed, keyring)  # what the worker will check: never store what it would refuse
        cur.execute("INSERT INTO action_approvals (approval_id, action_id, approver, signed) VALUES (%s, %s, %s, %s)",
                    (statement.approval_id, action_id, identity, store._json(signed)))
        approvers.add(identity)
        required = policy.policy.for_type(envelope.action_type).approvers_required if policy else 1
        evidence = {"approval_id": statement.approval_id, "approver": identity, "plan_hash": plan_hash,
                    "approvers": sorted(approvers), "required": required, "expires_at": statement.expires_at.isoformat(),
                    "covers_irreversible": covers_irreversible, "max_amount_cents": max_amount_cents,
                    "note": scrub_text(note)}
        store.append_event_txn(cur, action_id, "approval_recorded", identity, evidence)
        released = len(approvers) >= required
        if released:
            store.transition_txn(cur, action_id, [ActionStatus.proposed], ActionStatus.published,
                                 reason_code="approved", actor=identity)
    queue = "compensate" if envelope.recovers else "actions"
    task_id = dispatch.execute(action.signed_message, queue=queue) if released else None
    return {**evidence, "released": released, "task_id": task_id}


def deny(conn: Any, action_id: str, by: str, reason: str) -> dict[str, Any]:
    """Close a proposal as not started, naming who denied it and why."""
    reason = scrub_text(reason)
    with store.transaction(conn) as cur:
        _locked_proposal(cur, action_id)
        store.transition_txn(cur, action_id, [ActionStatus.proposed], ActionStatus.closed, outcome=Outcome.not_started,
                             reason_code="proposal_denied", events=[("proposal_denied", {"by": by, "reason": reason})],
                             actor=by)
    return {"action_id": action_id, "denied": True, "by": by, "reason": reason}


def revoke_approval(conn: Any, approval_id: str, by: str, reason: str) -> bool:
    """Revoke one approval: every action not yet sent that carries it is refused from now on
    (``approval_revoked``). False when it was already revoked."""
    reason = scrub_text(reason)
    with store.transaction(conn) as cur:
        cur.execute("INSERT INTO approval_revocations (approval_id, revoked_by, reason) VALUES (%s, %s, %s) "
                    "ON CONFLICT DO NOTHING RETURNING approval_id", (approval_id, by, reason))
        if cur.fetchone() is None:
            return False
        store.append_event_txn(cur, f"approval:{approval_id}", "approval_revoked", by,
                               {"approval_id": approval_id, "reason": reason})
        return True


def list_revoked_approvals(conn: Any) -> list[dict[str, Any]]:
    with conn.cursor() as cur:
        cur.execute("SELECT approval_id, revoked_by, reason, revoked_at FROM approval_revocations ORDER BY revoked_at")
        return list(cur.fetchall())
