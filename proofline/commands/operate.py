"""What operators do by hand: kill switches, revocations, cancellations, the manual queue and
retries. Every change connects as the operator role and is recorded with who and why."""

from __future__ import annotations

from typing import Any

import click

from proofline.commands.base import connect, dash, emit, emit_rows, json_value, settings, ts


def dispatcher():
    """The Celery dispatch operator commands send through (cancel's revoke, retry's send)."""
    from worker.dispatch import CeleryDispatch
    from worker.tasks import app

    return CeleryDispatch(app)


def broker_send(action_id: str, send):
    """Run a send to the broker; a broker that is away leaves the recorded change in place."""
    from kombu.exceptions import OperationalError

    from proofline.controller import broker_error
    from proofline.errors import BrokerUnavailable

    try:
        return send()
    except OperationalError as exc:
        raise BrokerUnavailable(f"the broker is unreachable ({broker_error(exc)}); {action_id} is recorded and the "
                                "reconciler sends it once the broker is back", action_id=action_id) from None


# --- kill switches ----------------------------------------------------------------------------------


@click.group()
def kill() -> None:
    """Kill switches: per action type, tool, tenant, tool for one tenant (tool@tenant), or global."""


SCOPES = ["global", "action_type", "tool", "tenant", "tool_tenant"]


def _switch_options(command):
    """--scope, --value, --by and --why: what every kill switch change records."""
    for option in reversed([
        click.option("--scope", type=click.Choice(SCOPES), required=True),
        click.option("--value", default="", help="an action type, server:tool (*:tool or a bare tool: every "
                     "server), a tenant, or server:tool@tenant"),
        click.option("--by", "who", required=True),
        click.option("--why", required=True),
    ]):
        command = option(command)
    return command


@kill.command("set")
@_switch_options
@click.option("--any-tenant", is_flag=True, help="accept a tenant the ledger has not seen yet")
def kill_set(scope: str, value: str, who: str, why: str, any_tenant: bool) -> None:
    """Engage a switch. Its value is checked against the contracts' action types and tools and the
    ledger's tenants: a switch that would block nothing is refused (exit 12)."""
    with connect("operator") as conn:
        value, engaged = engage_switch(conn, scope, value, who, why, any_tenant=any_tenant)
    emit({"scope": scope, "value": value, "engaged": engaged},
         f"kill switch {scope}:{value or '*'} {'set' if engaged else 'was already set'}")


def engage_switch(conn, scope: str, value: str, who: str, why: str, *, any_tenant: bool = False) -> tuple[str, bool]:
    """Check a switch's value against the contracts' action types and tools and the ledger's tenants
    (``KillSwitchInvalid`` when it would block nothing), then engage it: (value as matched, newly set).
    The CLI and the console both set switches through here."""
    from ledger.states import KillSwitchScope
    from proofline.contracts import load_contracts
    from recovery.operator import check_switch, known_tenants, set_switch

    kind = KillSwitchScope(scope)
    loaded = load_contracts(settings().contracts_dir)
    known = {"action_types": [*loaded.contracts, *loaded.broken], "tools": [c.tool for c in loaded.contracts.values()],
             "servers": [c.server for c in loaded.contracts.values()]}
    value = check_switch(kind, value, tenants=None, **known)  # its shape first
    if not any_tenant and kind in (KillSwitchScope.tenant, KillSwitchScope.tool_tenant):
        check_switch(kind, value, tenants=known_tenants(conn), **known)
    return value, set_switch(conn, kind, value, who, why)


@kill.command("clear")
@_switch_options
def kill_clear(scope: str, value: str, who: str, why: str) -> None:
    """Clear an engaged switch (any value that is set can be cleared)."""
    from ledger.states import KillSwitchScope
    from recovery.operator import clear_switch

    with connect("operator") as conn:
        cleared = clear_switch(conn, KillSwitchScope(scope), value.strip(), who, why)
    emit({"scope": scope, "value": value, "cleared": cleared},
         f"kill switch {scope}:{value or '*'} {'cleared' if cleared else 'was not set'}")


@kill.command("list")
def kill_list() -> None:
    """Engaged kill switches."""
    from recovery.operator import list_switches

    with connect("reader") as conn:
        rows = list_switches(conn)
    emit_rows("kill_switches", rows, lambda r: f"{r['scope']:<12} {r['value'] or '*':<30} {r['set_by']:<24} "
              f"{ts(r['set_at'])}  {r['reason']}", "no kill switch is engaged")


# --- revocations -----------------------------------------------------------------------------------


@click.command()
@click.argument("identity")
@click.option("--by", required=True)
@click.option("--reason", required=True)
def revoke(identity: str, by: str, reason: str) -> None:
    """Revoke a requester or workload identity: its queued actions will not start."""
    from recovery.operator import revoke as do_revoke

    with connect("operator") as conn:
        new = do_revoke(conn, identity, by, reason)
    emit({"identity": identity, "revoked": True, "already": not new},
         f"revoked {identity}" if new else f"{identity} was already revoked")


@click.group()
def revocations() -> None:
    """Revoked identities: list them, lift one."""


@revocations.command("list")
def revocations_list() -> None:
    from recovery.operator import list_revocations

    with connect("reader") as conn:
        rows = list_revocations(conn)
    emit_rows("revocations", rows, lambda r: f"{r['identity']:<32} {r['revoked_by']:<24} {ts(r['revoked_at'])}  "
              f"{r['reason']}", "no identity is revoked")


@revocations.command("lift")
@click.argument("identity")
@click.option("--by", required=True)
@click.option("--why", required=True)
def revocations_lift(identity: str, by: str, why: str) -> None:
    """Lift a revocation: actions of this identity may start again (recorded in the ledger)."""
    from proofline.errors import NotFound
    from recovery.operator import lift_revocation

    with connect("operator") as conn:
        if not lift_revocation(conn, identity, by, why):
            raise NotFound(f"{identity} is not revoked", identity=identity)
    emit({"identity": identity, "lifted": True}, f"revocation of {identity} lifted")


# --- cancellation, the manual queue, retry ---------------------------------------------------------


@click.command()
@click.argument("action_id")
@click.option("--by", "who", required=True, help="who asks for the cancellation")
@click.option("--why", required=True)
def cancel(action_id: str, who: str, why: str) -> None:
    """Cancel an action: stop new work, signal an in-flight call, reconcile before calling it cancelled."""
    from recovery.cancel import cancel as do_cancel

    with connect("operator") as conn:
        result = broker_send(action_id, lambda: do_cancel(conn, dispatcher(), action_id, who, why))
    emit(result, lambda: _cancel_text(result))


def _cancel_text(result: dict[str, Any]) -> str:
    if result.get("accepted"):
        return f"cancellation of {result['action_id']} requested (status {dash(result.get('status'))})"
    if result.get("status") is None:
        return f"no action {result['action_id']}"
    return f"{result['action_id']} is {result['status']}: nothing to cancel"


@click.group()
def manual() -> None:
    """The manual-intervention queue."""


@manual.command("list")
def manual_list() -> None:
    """Escalated actions, oldest first, with the evidence that put them there."""
    from recovery.operator import manual_queue

    with connect("reader") as conn:
        rows = manual_queue(conn)
    emit({"actions": rows}, lambda: _manual_text(rows))


#: The manual queue's columns: a header line names them, as ``actions list`` does.
MANUAL_COLUMNS = (("escalated", 27), ("action", 32), ("type", 16), ("tenant", 10), ("outcome", 26),
                  ("reason", 28), ("recovery", 0))


def _manual_text(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "the manual-intervention queue is empty"
    lines = [" ".join(f"{name:<{width}}" for name, width in MANUAL_COLUMNS).rstrip()]
    for r in rows:
        cells = (ts(r["updated_at"]), r["action_id"], r["action_type"], r["tenant"], dash(r["outcome"]),
                 dash(r["reason_code"]), dash(r["recovery_kind"]))
        lines.append(" ".join(f"{cell:<{width}}" for cell, (_, width) in zip(cells, MANUAL_COLUMNS, strict=True)))
    return "\n".join(lines)


@manual.command("resolve")
@click.argument("action_id")
@click.option("--as", "resolution", type=click.Choice(["succeeded", "failed", "no_effect", "compensated"]),
              required=True)
@click.option("--by", "who", required=True)
@click.option("--reason", required=True)
@click.option("--evidence", default="{}", help="JSON: what the operator checked")
def manual_resolve(action_id: str, resolution: str, who: str, reason: str, evidence: str) -> None:
    """Close an escalated action with what the operator found."""
    from recovery.operator import resolve

    checked = json_value("--evidence", evidence)
    with connect("operator") as conn:
        resolve(conn, action_id, resolution, who, reason, checked)
    emit({"action_id": action_id, "resolved_as": resolution}, f"{action_id} resolved as {resolution}")


@click.command()
@click.argument("action_id")
@click.option("--by", "who", required=True, help="the operator, recorded with the retry")
@click.option("--why", required=True)
def retry(action_id: str, who: str, why: str) -> None:
    """Send an escalated action again (same envelope, same idempotency key) when its effect is
    proven absent; refused otherwise, with the reason (exit 11)."""
    from recovery.operator_retry import retry_escalated

    with connect("operator") as conn:
        result = broker_send(action_id, lambda: retry_escalated(settings(), conn, dispatcher(), action_id, who, why))
    emit(result, f"{action_id} sent again (call {result['calls_made'] + 1} of at most {result['calls_allowed']}; "
                 f"proof of absence: {result['proof']['finding'] or result['proof']['outcome']}, idempotency record "
                 f"{result['proof']['idempotency_record']})")


COMMANDS = (kill, revoke, revocations, cancel, manual, retry)
