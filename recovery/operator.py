"""What operators do by hand: kill switches, and the manual-intervention queue.

Every operator act is a ledger event naming who and why. Kill switches are recorded in their own
chain (``killswitch:<scope>:<value>``); resolutions in the action's own chain, as an
``operator_intervention``.
"""

from __future__ import annotations

from typing import Any

from ledger import store
from ledger.states import ActionStatus, KillSwitchScope, Outcome
from recovery.settle import set_kill_switch_txn

RESOLUTIONS = {
    "succeeded": Outcome.completed_verified,
    "failed": Outcome.failed_after_side_effect,
    "no_effect": Outcome.failed_before_side_effect,
    "compensated": Outcome.compensated,
}


def set_switch(conn: Any, scope: KillSwitchScope, value: str, by: str, why: str) -> bool:
    with store.transaction(conn) as cur:
        return set_kill_switch_txn(cur, scope, "" if scope == KillSwitchScope.global_ else value, by, why)


def clear_switch(conn: Any, scope: KillSwitchScope, value: str, by: str, why: str) -> bool:
    value = "" if scope == KillSwitchScope.global_ else value
    with store.transaction(conn) as cur:
        cur.execute("""UPDATE kill_switches SET cleared_at = clock_timestamp(), cleared_by = %s
                       WHERE scope = %s AND value = %s AND cleared_at IS NULL RETURNING id""", (by, scope.value, value))
        cleared = cur.fetchone() is not None
        if cleared:
            store.append_event_txn(cur, f"killswitch:{scope.value}:{value}", "kill_switch_cleared", by,
                                   {"scope": scope.value, "value": value, "reason": why})
        return cleared


def list_switches(conn: Any) -> list[dict[str, Any]]:
    with conn.cursor() as cur:
        cur.execute("SELECT scope, value, set_by, reason, set_at FROM kill_switches WHERE cleared_at IS NULL "
                    "ORDER BY set_at")
        return list(cur.fetchall())


def manual_queue(conn: Any) -> list[dict[str, Any]]:
    """Actions waiting for an operator, with the evidence that put them there."""
    with conn.cursor() as cur:
        cur.execute("""SELECT a.action_id, a.action_type, a.tenant, a.tool, a.outcome, a.finding, a.reason_code,
                              a.recovery_kind, a.updated_at, a.recovery_data,
                              (SELECT json_agg(json_build_object('seq', e.seq, 'event', e.event, 'evidence', e.evidence)
                                               ORDER BY e.seq)
                                 FROM ledger_events e WHERE e.action_id = a.action_id
                                  AND e.event IN ('tool_called', 'verification_finished', 'recovery_decided',
                                                  'escalated', 'compensation_failed', 'contained')) AS evidence
                       FROM actions a WHERE a.status = 'escalated' ORDER BY a.updated_at""")
        return list(cur.fetchall())


def resolve(conn: Any, action_id: str, resolution: str, by: str, reason: str, evidence: dict[str, Any]) -> None:
    """Close an escalated action with the operator's finding, recorded as an intervention."""
    if resolution not in RESOLUTIONS:
        raise ValueError(f"resolution must be one of {sorted(RESOLUTIONS)}")
    with store.transaction(conn) as cur:
        store.append_event_txn(cur, action_id, "operator_intervention", by,
                               {"resolution": resolution, "reason": reason, "evidence": evidence})
        store.transition_txn(cur, action_id, [ActionStatus.escalated], ActionStatus.closed,
                             outcome=RESOLUTIONS[resolution], reason_code=f"operator_{resolution}")
