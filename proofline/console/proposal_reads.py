"""What the Proposals, Approvals and Authority pages show, read as the reader role.

The list and the one-proposal view start from :mod:`recovery.proposals` (what the CLI's
``proposals list`` and ``proposals show`` print) and add what a person deciding needs next to it:
how many approvers the policy in force requires, every plan the ledger recorded for the action
(and where there are two or more, what changed between the last two), the precondition snapshot
when the worker recorded one, and which of the recorded approvals were revoked since.

The console runs no tool servers, so nothing here reads the system of record: every comparison is
between things the ledger holds, and the pages say so.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from proofline.authority import SignedPolicy, load_policy
from proofline.keys import load_keyring
from proofline.plan import plan_diff
from recovery.proposals import list_proposals, proposal

#: Ledger events whose evidence may hold a whole plan (``content`` and ``plan_hash``): a proposal,
#: a simulation, and the refusal of a commit whose freshly prepared plan was not the approved one
#: (``plan_changed`` is recorded as ``revalidation_failed`` with that new plan).
PLAN_EVENTS = ("proposed", "simulated", "revalidation_failed")
PRECONDITION_EVENTS = ("preconditions_passed", "preconditions_failed")


def policy_in_force(settings: Any) -> SignedPolicy | None:
    """The signed authority policy the workers load, verified against the keyring; ``None`` when
    none is configured (development: the controller's approval is the only authority)."""
    keyring = load_keyring(settings.keyring_file, settings.environment)
    return load_policy(settings.authority_file, keyring, settings.environment)


def required_for(policy: SignedPolicy | None, action_type: str) -> int:
    return policy.policy.for_type(action_type).approvers_required if policy else 1


def _age(since: datetime) -> str:
    seconds = max(0, int((datetime.now(UTC) - since).total_seconds()))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h" if seconds < 172800 else f"{seconds // 86400} d"


def proposals_page(conn: Any, policy: SignedPolicy | None) -> list[dict[str, Any]]:
    """Every proposal, oldest first, with its age, approvals so far and approvals required."""
    rows = []
    for row in list_proposals(conn):
        plan = row["evidence"] or {}
        rows.append({**row, "age": _age(row["proposed_at"]), "required": required_for(policy, row["action_type"]),
                     "point_of_no_return": bool(plan.get("point_of_no_return")),
                     "outside_bounds": plan.get("outside_bounds"), "plan_hash": plan.get("plan_hash")})
    return rows


def _events(cur: Any, action_id: str, names: tuple[str, ...]) -> list[dict[str, Any]]:
    cur.execute("SELECT seq, at, event, actor, evidence FROM ledger_events WHERE action_id = %s AND event = ANY(%s) "
                "ORDER BY seq", (action_id, list(names)))
    return list(cur.fetchall())


def proposal_page(conn: Any, action_id: str, policy: SignedPolicy | None) -> dict[str, Any]:
    """One proposal (or an action that was one): its plan, the plans before it and what changed,
    the precondition snapshot, the approvals with their revocations, and the decision if made."""
    found = proposal(conn, action_id)
    with conn.cursor() as cur:
        plans = [p for p in _events(cur, action_id, PLAN_EVENTS) if isinstance(p["evidence"].get("content"), dict)]
        preconditions = _events(cur, action_id, PRECONDITION_EVENTS)
        decisions = _events(cur, action_id, ("approval_recorded", "proposal_denied"))
        ids = [a["approval_id"] for a in found["approvals"]]
        cur.execute("SELECT approval_id, revoked_by, reason FROM approval_revocations WHERE approval_id = ANY(%s)",
                    (ids,))
        revoked = {r["approval_id"]: r for r in cur.fetchall()}
    diff = None
    if len(plans) >= 2:
        older, newer = plans[-2], plans[-1]
        diff = {"older": older, "newer": newer,
                "changes": plan_diff(older["evidence"]["content"], newer["evidence"]["content"])}
    approvers = sorted({a["approver"] for a in found["approvals"]})
    return {**found, "plan": found["plan"] or {}, "plans": plans, "diff": diff, "preconditions": preconditions,
            "decisions": decisions, "revoked": revoked, "approvers": approvers,
            "required": required_for(policy, found["action_type"])}


def revoked_approvals(conn: Any) -> list[dict[str, Any]]:
    """Revoked approvals, oldest first, with the action each one approved (when it was recorded)."""
    with conn.cursor() as cur:
        cur.execute("SELECT r.approval_id, r.revoked_by, r.reason, r.revoked_at, p.action_id, p.approver "
                    "FROM approval_revocations r LEFT JOIN action_approvals p USING (approval_id) "
                    "ORDER BY r.revoked_at, r.approval_id")
        return list(cur.fetchall())


def recorded_approvals(conn: Any, limit: int = 100) -> list[dict[str, Any]]:
    """The most recent approvals recorded through proposals, newest first, each marked if revoked."""
    with conn.cursor() as cur:
        cur.execute("SELECT p.approval_id, p.action_id, p.approver, p.recorded_at, a.status, "
                    "(r.approval_id IS NOT NULL) AS revoked FROM action_approvals p "
                    "JOIN actions a USING (action_id) LEFT JOIN approval_revocations r USING (approval_id) "
                    "ORDER BY p.recorded_at DESC LIMIT %s", (limit,))
        return list(cur.fetchall())
