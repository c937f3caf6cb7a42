"""What operators do by hand: kill switches, revocations, and the manual-intervention queue.

Every operator act is a ledger event naming who and why. Kill switches are recorded in their own
chain (``killswitch:<scope>:<value>``), revocations in ``revocation:<identity>``; resolutions in the
action's own chain, as an ``operator_intervention``. A kill switch that would block nothing (no
value, a name no contract or ledger knows) is refused before it is recorded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ledger import store
from ledger.redact import scrub_text
from ledger.states import ActionStatus, KillSwitchScope, Outcome
from proofline.errors import KillSwitchInvalid, NotFound, TransitionRefused
from recovery.settle import set_kill_switch_txn

RESOLUTIONS = {
    "succeeded": Outcome.completed_verified,
    "failed": Outcome.failed_after_side_effect,
    "no_effect": Outcome.failed_before_side_effect,
    "compensated": Outcome.compensated,
}


def known_tenants(conn: Any) -> set[str]:
    """Tenants the ledger has seen an action for."""
    with conn.cursor() as cur:
        cur.execute("SELECT DISTINCT tenant FROM actions")
        return {r["tenant"] for r in cur.fetchall()}


def scoped_tool(value: str) -> str:
    """A tool switch's value in its scoped form ``SERVER:TOOL`` (``@TENANT`` kept): the old
    tool-only form means that tool on every server, ``*:TOOL``."""
    value = value.strip()
    return value if ":" in value.partition("@")[0] else "*:" + value


def check_switch(scope: KillSwitchScope, value: str, *, action_types: Iterable[str], tools: Iterable[str],
                 tenants: Iterable[str] | None, servers: Iterable[str] | None = None) -> str:
    """The switch's value as it will be matched, or :class:`KillSwitchInvalid` naming why it would
    block nothing. ``tenants=None`` accepts any tenant name (one the ledger has not seen yet),
    ``servers=None`` any server name. Tool switches are scoped by server (``SERVER:TOOL``, ``*`` for
    every server); a bare ``TOOL`` is accepted and means ``*:TOOL``."""
    value = value.strip()
    if scope == KillSwitchScope.global_:
        if value:
            raise KillSwitchInvalid(f"--scope global takes no value (got {value!r})")
        return ""
    if not value:
        example = {"tool_tenant": "sor:create_ticket@acme", "action_type": "ticket.create",
                   "tool": "sor:create_ticket", "tenant": "acme"}[scope.value]
        raise KillSwitchInvalid(f"--scope {scope.value} needs a value, e.g. --value {example}")
    if scope == KillSwitchScope.tool_tenant:
        value = scoped_tool(value)
        tool, at, tenant = value.partition("@")
        if not at or not tool.partition(":")[2] or not tenant or "@" in tenant:
            raise KillSwitchInvalid(f"--scope tool_tenant needs [SERVER:]TOOL@TENANT, got {value!r}")
        _known_tool(tool, tools, servers)
        if tenants is not None:
            _known("tenant", tenant, tenants)
        return value
    if scope == KillSwitchScope.action_type:
        _known("action type", value, action_types)
    elif scope == KillSwitchScope.tool:
        value = scoped_tool(value)
        if "@" in value:
            raise KillSwitchInvalid(f"--scope tool takes [SERVER:]TOOL (for one tenant: --scope tool_tenant), "
                                    f"got {value!r}")
        _known_tool(value, tools, servers)
    elif tenants is not None:
        _known("tenant", value, tenants)
    return value


def _known_tool(scoped: str, tools: Iterable[str], servers: Iterable[str] | None) -> None:
    server, _, tool = scoped.partition(":")
    if not server or not tool:
        raise KillSwitchInvalid(f"a tool switch is SERVER:TOOL or TOOL, got {scoped!r}", value=scoped)
    _known("tool", tool, tools)
    if server != "*" and servers is not None:
        _known("server", server, servers)


def _known(kind: str, value: str, known: Iterable[str]) -> None:
    names = sorted(set(known))
    if value not in names:
        shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
        hint = " (--any-tenant to block a tenant before its first action)" if kind == "tenant" else ""
        raise KillSwitchInvalid(f"no {kind} {value!r} is known; known: {shown or 'none'}{hint}", value=value)


def set_switch(conn: Any, scope: KillSwitchScope, value: str, by: str, why: str) -> bool:
    """Engage a switch (a tool switch in its scoped form: a bare ``TOOL`` means ``*:TOOL``)."""
    if scope in (KillSwitchScope.tool, KillSwitchScope.tool_tenant):
        value = scoped_tool(value)
    with store.transaction(conn) as cur:
        return set_kill_switch_txn(cur, scope, "" if scope == KillSwitchScope.global_ else value, by, why)


def clear_switch(conn: Any, scope: KillSwitchScope, value: str, by: str, why: str) -> bool:
    """Clear an engaged switch; a tool switch may be named in the old tool-only form (``*:TOOL``)."""
    value = "" if scope == KillSwitchScope.global_ else value.strip()
    if scope in (KillSwitchScope.tool, KillSwitchScope.tool_tenant):
        value = scoped_tool(value)
    with store.transaction(conn) as cur:
        cur.execute("""UPDATE kill_switches SET cleared_at = clock_timestamp(), cleared_by = %s
                       WHERE scope = %s AND value = %s AND cleared_at IS NULL RETURNING id""", (by, scope.value, value))
        cleared = cur.fetchone() is not None
        if cleared:
            store.append_event_txn(cur, f"killswitch:{scope.value}:{value}", "kill_switch_cleared", by,
                                   {"scope": scope.value, "value": value, "reason": why})
        return cleared


def revoke(conn: Any, identity: str, by: str, why: str) -> bool:
    """Revoke a requester or workload identity; False when it was already revoked."""
    why = scrub_text(why)
    with store.transaction(conn) as cur:
        cur.execute("SELECT 1 FROM revoked_identities WHERE identity = %s", (identity,))
        if cur.fetchone() is not None:
            return False
        store.revoke_identity_txn(cur, identity, by, why)
        store.append_event_txn(cur, f"revocation:{identity}", "identity_revoked", by,
                               {"identity": identity, "reason": why})
        return True


def lift_revocation(conn: Any, identity: str, by: str, why: str) -> bool:
    """Lift a revocation (its actions may start again); False when the identity was not revoked."""
    why = scrub_text(why)
    with store.transaction(conn) as cur:
        cur.execute("DELETE FROM revoked_identities WHERE identity = %s RETURNING revoked_by, reason, revoked_at",
                    (identity,))
        row = cur.fetchone()
        if row is None:
            return False
        store.append_event_txn(cur, f"revocation:{identity}", "revocation_lifted", by,
                               {"identity": identity, "reason": why, "revoked_by": row["revoked_by"],
                                "revoked_for": row["reason"], "revoked_at": row["revoked_at"].isoformat()})
        return True


def list_revocations(conn: Any) -> list[dict[str, Any]]:
    with conn.cursor() as cur:
        cur.execute("SELECT identity, revoked_by, reason, revoked_at FROM revoked_identities ORDER BY revoked_at")
        return list(cur.fetchall())


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
        current = store.get_action(cur, action_id)
        if current is None:
            raise NotFound(f"no action {action_id}", action_id=action_id)
        if current.status != ActionStatus.escalated:
            raise TransitionRefused(f"{action_id} is {current.status.value}, not escalated: only an escalated "
                                    "action is resolved by hand", action_id=action_id)
        store.append_event_txn(cur, action_id, "operator_intervention", by,
                               {"resolution": resolution, "reason": reason, "evidence": evidence})
        store.transition_txn(cur, action_id, [ActionStatus.escalated], ActionStatus.closed,
                             outcome=RESOLUTIONS[resolution], reason_code=f"operator_{resolution}")
