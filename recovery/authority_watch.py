"""Authority grown on evidence: what the ledger shows per action type and mode, promotion only
when the policy's thresholds hold, and automatic demotion on a regression.

The evidence is what the worker recorded itself: every authorized action's ``revalidated`` event
names the mode it ran under and the hash of the signed policy that allowed it
(``worker/authorize.py``). :func:`evidence` counts, per action type and mode over a window, the
actions run, verified, left unresolved (the runtime could not prove the final state), failed
verifications, compensations and their success, and manual resolutions.

:func:`demote_on_regressions` runs with the reconciler's sweep: an action type whose actions,
authorized under the policy in force at a rung above its ``demote_to``, show a regression (an
escalated action the runtime could not settle, a failed compensation, a post-condition that did
not hold, at verification or at a later re-check) is demoted to ``demote_to`` until an approver
signs a new policy. The demotion is a row the worker reads on every action, a ledger event on the
chain ``authority:<type>``, and a warning log that the ``authority_demotions`` counter and its
alert turn into a page.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from ledger import store
from proofline.authority import AuthorityMode, AuthorityPolicy, Promotion, SignedPolicy, policy_in_force
from proofline.errors import AuthorityPolicyInvalid, PromotionRefused
from proofline.settings import Settings
from worker.authorize import effective_mode

log = logging.getLogger(__name__)

#: The latest authorization of each action (its mode and policy) joined with where it stands now.
AUTHORIZED = """
WITH authorized AS (
  SELECT DISTINCT ON (e.action_id) e.action_id, e.evidence #>> '{authority,mode}' AS mode,
         e.evidence #>> '{authority,policy_hash}' AS policy_hash
    FROM ledger_events e
   WHERE e.event = 'revalidated' AND e.at >= %(since)s AND e.evidence ? 'authority'
   ORDER BY e.action_id, e.seq DESC)
"""

EVIDENCE_SQL = AUTHORIZED + """
SELECT a.action_type, au.mode,
       count(*) AS actions,
       count(*) FILTER (WHERE a.outcome = 'completed_verified') AS verified,
       count(*) FILTER (WHERE a.status = 'escalated' AND a.outcome IN ('unknown_outcome', 'completed_unverified'))
         AS unresolved,
       count(*) FILTER (WHERE a.finding IN ('prohibited', 'not_reached')) AS verification_failures,
       count(*) FILTER (WHERE a.outcome = 'compensated') AS compensated,
       count(*) FILTER (WHERE a.outcome = 'compensation_failed') AS compensation_failed,
       count(*) FILTER (WHERE EXISTS (SELECT 1 FROM ledger_events m WHERE m.action_id = a.action_id
                                        AND m.event LIKE 'manual\\_%%')) AS manual_resolutions
  FROM authorized au JOIN actions a ON a.action_id = au.action_id
 WHERE a.kind = 'action' AND (%(type)s::text IS NULL OR a.action_type = %(type)s)
 GROUP BY a.action_type, au.mode
 ORDER BY a.action_type, au.mode
"""

# Regressions, authorized under one policy: open ones (escalated, an operator's turn, or in
# recovery), and post-conditions that no longer held at a re-check, however recovery settled them.
REGRESSIONS_SQL = """
SELECT a.action_id, a.action_type, a.status::text AS status, a.outcome::text AS outcome, a.finding,
       e.evidence #>> '{authority,mode}' AS mode
  FROM actions a
  JOIN LATERAL (SELECT evidence FROM ledger_events WHERE action_id = a.action_id AND event = 'revalidated'
                 ORDER BY seq DESC LIMIT 1) e ON true
 WHERE a.kind = 'action' AND e.evidence #>> '{authority,policy_hash}' = %s
   AND (a.status IN ('escalated', 'recovery')
        OR a.action_id IN (SELECT c.action_id FROM postcondition_checks c WHERE c.status = 'regressed'))
"""


def evidence(conn: Any, action_type: str | None, window: timedelta, now: datetime) -> list[dict[str, Any]]:
    """Per action type and mode, what the ledger shows over ``window`` up to ``now``."""
    with conn.cursor() as cur:
        cur.execute(EVIDENCE_SQL, {"since": now - window, "type": action_type})
        rows = [dict(r) for r in cur.fetchall()]
    for row in rows:
        settled = row["compensated"] + row["compensation_failed"]
        row["compensation_success"] = (row["compensated"] / settled) if settled else None
    return rows


def shortfalls(row: dict[str, Any] | None, rule: Promotion) -> list[str]:
    """What keeps an action type from moving up a rung, read from its evidence at its current rung."""
    if row is None:
        return [f"no action ran in this mode in the last {rule.window_days} days"]
    missing = []
    if row["verified"] < rule.min_verified:
        missing.append(f"{row['verified']} verified, {rule.min_verified} required")
    if row["unresolved"] > rule.max_open_unknown:
        missing.append(f"{row['unresolved']} outcomes left unresolved, at most {rule.max_open_unknown} allowed")
    if row["verification_failures"] > rule.max_verification_failures:
        missing.append(f"{row['verification_failures']} verification failures, at most "
                       f"{rule.max_verification_failures} allowed")
    success = row["compensation_success"]
    if success is not None and success < rule.min_compensation_success:
        missing.append(f"compensation success {success:.0%}, {rule.min_compensation_success:.0%} required")
    return missing


def promoted(conn: Any, loaded: SignedPolicy, action_type: str, to: AuthorityMode, now: datetime
             ) -> tuple[AuthorityPolicy, dict[str, Any]]:
    """The policy with ``action_type`` moved up to ``to``, and the evidence that allowed it; or
    ``promotion_refused`` naming every threshold that does not hold."""
    policy = loaded.policy
    current = effective_mode(conn, loaded, action_type)[0]
    if to.rank <= current.rank:
        raise PromotionRefused(f"{action_type} runs in {current.value}; {to.value} is not above it",
                               action_type=action_type)
    if to == AuthorityMode.autonomous and policy.for_type(action_type).bounds is None:
        raise PromotionRefused(f"{action_type} has no bounds in the policy: autonomy is only ever bounded",
                               action_type=action_type)
    rule = policy.promotion
    rows = {r["mode"]: r for r in evidence(conn, action_type, timedelta(days=rule.window_days), now)}
    missing = shortfalls(rows.get(current.value), rule)
    if missing:
        raise PromotionRefused(f"{action_type} cannot leave {current.value}: {'; '.join(missing)}",
                               action_type=action_type, missing=" | ".join(missing))
    entry = policy.for_type(action_type).model_copy(update={"mode": to})
    types = {**policy.action_types, action_type: entry}
    new = policy.model_copy(update={"version": policy.version + 1, "action_types": types})
    return new, {"action_type": action_type, "from": current.value, "to": to.value, "evidence": rows[current.value],
                 "thresholds": rule.model_dump(mode="json"), "previous_policy_hash": loaded.hash}


def demote_on_regressions(conn: Any, loaded: SignedPolicy | None, actor: str) -> list[dict[str, Any]]:
    """Demote every action type with an open regression above its ``demote_to`` rung (once per
    policy). Returns the demotions recorded."""
    if loaded is None:
        return []
    with conn.cursor() as cur:
        cur.execute(REGRESSIONS_SQL, (loaded.hash,))
        open_regressions = list(cur.fetchall())
    by_type: dict[str, list[dict[str, Any]]] = {}
    for row in open_regressions:
        by_type.setdefault(row["action_type"], []).append(row)
    recorded = []
    for action_type, rows in sorted(by_type.items()):
        rule = loaded.policy.for_type(action_type)
        if rule.demote_to is None:
            continue
        above = [r for r in rows if r["mode"] in {m.value for m in AuthorityMode}
                 and AuthorityMode(r["mode"]).rank > rule.demote_to.rank]
        if not above:
            continue
        first = above[0]
        evidence_doc = {"action_type": action_type, "policy_hash": loaded.hash, "from": first["mode"],
                        "to": rule.demote_to.value, "regressions": [
                            {k: r[k] for k in ("action_id", "status", "outcome", "finding", "mode")} for r in above[:20]]}
        reason = f"{len(above)} open regression(s), first {first['action_id']} ({first['status']}, {first['outcome']})"
        with store.transaction(conn) as cur:
            cur.execute("INSERT INTO authority_demotions (action_type, policy_hash, from_mode, to_mode, reason, evidence, "
                        "demoted_by) VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING id",
                        (action_type, loaded.hash, first["mode"], rule.demote_to.value, reason,
                         store._json(evidence_doc), actor))
            if cur.fetchone() is None:
                continue  # demoted already under this policy
            store.append_event_txn(cur, f"authority:{action_type}", "authority_demoted", actor,
                                   {**evidence_doc, "reason": reason})
        log.warning("authority demoted", extra={"event": "authority_demoted", "action_type": action_type,
                                                "to_mode": rule.demote_to.value, "reason": reason})
        recorded.append({**evidence_doc, "reason": reason})
    return recorded


def watch(conn: Any, settings: Settings, actor: str) -> list[dict[str, Any]]:
    """The reconciler's check: demotions for the policy in force (none without a policy; a policy
    the workers would refuse demotes nothing here: they refuse every action under it anyway)."""
    if settings.authority_file is None:
        return []  # unmanaged (development): nothing to watch
    try:
        loaded = policy_in_force(settings)
    except AuthorityPolicyInvalid as exc:
        log.warning("authority policy unusable", extra={"event": "authority_policy_invalid", "reason": exc.detail})
        return []
    record_policy_change(conn, loaded, actor)
    return demote_on_regressions(conn, loaded, actor)


def record_policy_change(conn: Any, loaded: SignedPolicy | None, actor: str) -> bool:
    """Ledger the policy in force when it is not the one the chain ``authority:policy`` last
    recorded (a newly signed file, or none any more), so every change of authority is an event even
    when no promotion made it. True when an event was appended."""
    current = {"policy_hash": loaded.hash, "version": loaded.policy.version, "signed_by": loaded.signed_by,
               "key_id": loaded.key_id} if loaded else {"policy_hash": None}
    with store.transaction(conn) as cur:
        cur.execute("SELECT evidence FROM ledger_events WHERE action_id = 'authority:policy' ORDER BY seq DESC LIMIT 1")
        last = cur.fetchone()
        previous = last["evidence"].get("policy_hash") if last else None
        if last is not None and previous == current["policy_hash"]:
            return False
        if last is None and loaded is None:
            return False
        store.append_event_txn(cur, "authority:policy", "authority_policy_changed", actor,
                               {**current, "previous_policy_hash": previous})
        return True


def record_promotion(conn: Any, by: str, evidence_doc: dict[str, Any], new_hash: str) -> None:
    with store.transaction(conn) as cur:
        store.append_event_txn(cur, f"authority:{evidence_doc['action_type']}", "authority_promoted", by,
                               {**evidence_doc, "policy_hash": new_hash})
