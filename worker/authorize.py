"""Authority: may this action change the world, and on whose signature?

The worker decides once per delivery, after the envelope and the live tool contract are
revalidated and before the lease is claimed, from three things it verifies itself: the signed
authority policy (``proofline/authority.py``), the approvals the action carries or that approvers
recorded for its proposal (``proofline/approvals.py``, each checked against the keyring), and the
contract's own point of no return (whatever the envelope's ``irreversible`` flag says).

The result is a route: ``execute`` (call the tool), ``propose`` (prepare the plan and wait for an
approver) or ``simulate`` (prepare the plan, commit nothing). Refusals are ``RevalidationFailed``
errors with their own reason codes: the action closes as ``not_started`` and nothing is called.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from proofline.approvals import verify_approvals
from proofline.authority import ActionAuthority, AuthorityMode, SignedPolicy, load_policy
from proofline.conditions import holds
from proofline.contracts import Contract
from proofline.envelope import Envelope
from proofline.errors import AuthorityModeRefused, ConditionError
from proofline.keys import Keyring, load_keyring
from worker.calls import TOOL_HINTS
from worker.runtime import Runtime

#: Mode recorded for a deployment with no authority policy (development and test only).
UNMANAGED = "unmanaged"

REVOKED_SQL = "SELECT approval_id, reason FROM approval_revocations WHERE approval_id = ANY(%s)"
# One statement for what the database holds about this action's authority: a demotion of its type
# under the policy in force, and which of the approvals it carries were revoked.
FACTS_SQL = """
SELECT (SELECT json_build_object('to_mode', to_mode, 'reason', reason) FROM authority_demotions
         WHERE action_type = %s AND policy_hash = %s) AS demotion,
       (SELECT json_object_agg(approval_id, reason) FROM approval_revocations WHERE approval_id = ANY(%s)) AS revoked
"""
RECORDED_SQL = "SELECT signed FROM action_approvals WHERE action_id = %s ORDER BY recorded_at, approval_id"
# Actions of this type and tenant inside the autonomy window that did, or may yet, change something.
WINDOW_SQL = """
SELECT count(*) AS n FROM actions
 WHERE action_type = %s AND tenant = %s AND action_id <> %s AND published_at >= %s
   AND status NOT IN ('pending', 'proposed') AND outcome IS DISTINCT FROM 'not_started'
"""


@dataclass
class Decision:
    """What the worker may do with this action, and the evidence of why."""

    route: str  # "execute", "propose" or "simulate"
    mode: str
    evidence: dict[str, Any] = field(default_factory=dict)
    #: The plan hash every approval that bound one names: the commit must find that same plan.
    approved_plan_hash: str | None = None
    point_of_no_return: bool = False


def _approval_ids(signed: list[Any]) -> list[str]:
    ids = []
    for item in signed:
        statement = item.get("approval") if isinstance(item, dict) else None
        if isinstance(statement, dict) and isinstance(statement.get("approval_id"), str):
            ids.append(statement["approval_id"][:200])
    return ids


def _recorded(rt: Runtime, action_id: str) -> list[Any]:
    with rt.conn.cursor() as cur:
        cur.execute(RECORDED_SQL, (action_id,))
        return [r["signed"] for r in cur.fetchall()]


def _revoked(rt: Runtime, signed: list[Any]) -> dict[str, str]:
    ids = _approval_ids(signed)
    if not ids:
        return {}
    with rt.conn.cursor() as cur:
        cur.execute(REVOKED_SQL, (ids,))
        return {r["approval_id"]: r["reason"] for r in cur.fetchall()}


def _plan_hashes(signed: list[Any]) -> set[str]:
    return {item["approval"]["plan_hash"] for item in signed
            if isinstance(item, dict) and isinstance(item.get("approval"), dict)
            and isinstance(item["approval"].get("plan_hash"), str)}


def check_approvals(rt: Runtime, envelope: Envelope, keyring: Keyring, signed: list[Any], now: datetime, *,
                    required: int, ponr: bool, amount: int | None,
                    revoked: dict[str, str] | None = None) -> tuple[dict[str, Any], str | None]:
    """Verify ``signed`` for this envelope. A plan an approval binds is checked against the fresh
    plan later (``plan_changed``); here every approval must name the same plan."""
    plans = _plan_hashes(signed)
    plan_hash = next(iter(plans)) if len(plans) == 1 else None
    if revoked is None:
        revoked = _revoked(rt, signed)
    evidence = verify_approvals(signed, envelope, keyring, now=now, revoked=revoked, required=required,
                                irreversible=ponr, amount_cents=amount, plan_hash=plan_hash)
    return {**evidence, **({"plan_hash": plan_hash} if plan_hash else {})}, plan_hash


def outside_bounds(rt: Runtime, envelope: Envelope, rule: ActionAuthority, now: datetime,
                   amount: int | None) -> str | None:
    """Why this action is outside its standing approval's bounds, or None when it is inside."""
    bounds = rule.bounds
    if bounds is None:
        return "no bounds declared"
    if bounds.max_amount_cents is not None and (amount or 0) > bounds.max_amount_cents:
        return f"amount {amount} above the bound {bounds.max_amount_cents}"
    doc = envelope.model_dump(mode="json")
    variables = {"envelope": doc, "args": doc["arguments"], "target": doc["target"]}
    for i, expr in enumerate(bounds.conditions):
        try:
            inside = holds(expr, variables)
        except ConditionError as exc:
            return f"bounds.conditions.{i} cannot be evaluated: {exc.detail[:200]}"
        if not inside:
            return f"bounds.conditions.{i} does not hold: {expr[:200]}"
    if bounds.max_actions_per_tenant is not None:
        with rt.conn.cursor() as cur:
            cur.execute(WINDOW_SQL, (envelope.action_type, envelope.tenant, envelope.action_id,
                                     now - timedelta(seconds=bounds.window_seconds)))
            used = int(cur.fetchone()["n"])
        if used + 1 > bounds.max_actions_per_tenant:
            return (f"{used} actions of this type for tenant {envelope.tenant} in the last "
                    f"{bounds.window_seconds} s; the bound is {bounds.max_actions_per_tenant}")
    return None


def effective_mode(conn: Any, loaded: SignedPolicy, action_type: str, approval_ids: list[str] | None = None
                   ) -> tuple[AuthorityMode, str | None, dict[str, str]]:
    """The policy's mode for ``action_type``, lowered by a demotion the runtime recorded under this
    very policy (``recovery/authority_watch.py``), the demotion's reason, and which of
    ``approval_ids`` are revoked (with their reasons)."""
    mode = loaded.policy.for_type(action_type).mode
    with conn.cursor() as cur:
        cur.execute(FACTS_SQL, (action_type, loaded.hash, approval_ids or []))
        row = cur.fetchone()
    demotion, revoked = row["demotion"], row["revoked"] or {}
    if demotion is not None and AuthorityMode(demotion["to_mode"]).rank < mode.rank:
        return AuthorityMode(demotion["to_mode"]), demotion["reason"], revoked
    return mode, None, revoked


def recovery_route(rt: Runtime, envelope: Envelope, policy: SignedPolicy, parent_link: dict[str, Any],
                   keyring: Keyring, now: datetime) -> Decision:
    """A recovery action (signed by recovery, derived from a verified parent) under the parent
    type's recovery policy: automatic, or proposed to an approver (the default when the parent moves
    money or is a point of no return)."""
    parent_type = str(parent_link.get("parent_action_type"))
    kind = parent_link.get("kind")
    parent = rt.contract(parent_type)
    chosen = policy.policy.for_type(parent_type).recovery.get(kind)  # type: ignore[call-overload]
    default = "proposed" if parent.amount_cents or parent.point_of_no_return else "automatic"
    how = chosen or default
    base = {"mode": "recovery", "recovery": how, "recovery_kind": kind, "parent_action_type": parent_type,
            "policy_hash": policy.hash, "policy_version": policy.policy.version, "policy_signed_by": policy.signed_by}
    if how == "automatic":
        return Decision("execute", "recovery", base)
    recorded = _recorded(rt, envelope.action_id)
    if not recorded:
        return Decision("propose", "recovery", base)
    rule = policy.policy.for_type(envelope.action_type)
    approvals, plan_hash = check_approvals(rt, envelope, keyring, recorded, now, required=rule.approvers_required,
                                           ponr=False, amount=None)
    return Decision("execute", "recovery", {**base, "approvals": approvals}, plan_hash)


def authorize(rt: Runtime, envelope: Envelope, contract: Contract, now: datetime,
              amount: int | None, parent_link: dict[str, Any] | None = None) -> Decision:
    """The route for this delivery under the signed policy, or a refusal (``RevalidationFailed``)."""
    settings = rt.settings
    keyring = load_keyring(settings.keyring_file, settings.environment)
    ponr = envelope.irreversible or contract.point_of_no_return
    hints = TOOL_HINTS.get(envelope.tool.contract_hash, {})
    signed = list(envelope.approvals)
    policy: SignedPolicy | None = load_policy(settings.authority_file, keyring, settings.environment)
    if policy is not None and parent_link is not None:
        return recovery_route(rt, envelope, policy, parent_link, keyring, now)
    if policy is None:
        # No policy (development, test): the controller's request is the authority, as before;
        # any signed approval it carries must still be valid.
        evidence: dict[str, Any] = {"mode": UNMANAGED}
        plan_hash = None
        if signed:
            approvals, plan_hash = check_approvals(rt, envelope, keyring, signed, now, required=1, ponr=False,
                                                   amount=None)
            evidence["approvals"] = approvals
        return Decision("execute", UNMANAGED, evidence, plan_hash, ponr)
    rule = policy.policy.for_type(envelope.action_type)
    mode, demoted, revoked = effective_mode(rt.conn, policy, envelope.action_type, _approval_ids(signed))
    base = {"mode": mode.value, "policy_hash": policy.hash, "policy_version": policy.policy.version,
            "policy_signed_by": policy.signed_by, **({"demoted": demoted} if demoted else {})}
    if ponr:
        base["point_of_no_return"] = {"declared_by": "contract" if contract.point_of_no_return else "envelope",
                                      "compensation": "not available"}
    if mode == AuthorityMode.read:
        if hints.get("readOnlyHint") is not True:
            raise AuthorityModeRefused(f"{envelope.action_type} runs in read mode; tool {envelope.tool.name} is not "
                                       "declared read-only by its server (readOnlyHint)", mode=mode.value)
        return Decision("execute", mode.value, {**base, "read_only_tool": envelope.tool.name})
    if mode == AuthorityMode.simulate:
        return Decision("simulate", mode.value, base)
    if mode == AuthorityMode.autonomous:
        why = None
        if ponr and rule.autonomous_reason is None:
            why = "a point of no return is never autonomous unless the policy names it with a reason"
        elif hints.get("destructiveHint") is True and rule.autonomous_reason is None:
            why = f"tool {envelope.tool.name} is destructive; the policy gives no reason to make it autonomous"
        else:
            why = outside_bounds(rt, envelope, rule, now, amount)
        if why is None:
            return Decision("execute", mode.value, {**base, "standing_approval": policy.hash,
                                                    **({"autonomous_reason": rule.autonomous_reason}
                                                       if rule.autonomous_reason else {})}, None, ponr)
        base["outside_bounds"] = why
        # Outside its bounds an autonomous action falls back to a proposal, never a silent refusal.
        mode = AuthorityMode.propose
    if mode == AuthorityMode.propose:
        recorded = _recorded(rt, envelope.action_id)
        revoked = _revoked(rt, signed + recorded)  # the recorded approvals were not in the first question
        # A recorded approval revoked since is no approval of this proposal any more: it waits again
        # for approvers rather than running on the rest.
        withdrawn = [i for i in _approval_ids(recorded) if i in revoked]
        recorded = [r for r in recorded if not set(_approval_ids([r])) & set(withdrawn)]
        if withdrawn:
            base["revoked_approvals_ignored"] = withdrawn
        if not recorded:
            return Decision("propose", mode.value, base)
        signed = signed + recorded
    approvals, plan_hash = check_approvals(rt, envelope, keyring, signed, now, required=rule.approvers_required,
                                           ponr=ponr, amount=amount, revoked=revoked)
    return Decision("execute", mode.value, {**base, "approvals": approvals}, plan_hash, ponr)

