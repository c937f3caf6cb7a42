"""Authority on the command line: the signed policy, approvals, proposals and their decisions.

``authority sign`` turns a policy YAML into the signed document workers load; ``approvals sign``
writes an approval of one intent for a controller to carry (mode ``approved``); ``proposals``,
``approve`` and ``deny`` act on actions waiting in mode ``propose``; ``approvals revoke`` withdraws
one approval. Every signature comes from an approver key file (``proofline keys add-approver``).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import click

from proofline.commands.base import connect, dash, emit, emit_rows, json_value, settings, ts

KEY_OPTION = click.option("--key", "key_file", required=True, type=click.Path(path_type=Path),
                          envvar="PROOFLINE_APPROVER_KEY_FILE", help="your approver key file")


def _approver_key(path: Path):
    from proofline.keys import KeyRole, load_signing_key

    return load_signing_key(path, KeyRole.approver, settings().environment)


@click.group()
def authority() -> None:
    """The signed authority policy: each action type's mode, approvers and bounds."""


@authority.command("sign")
@click.argument("policy_yaml", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@KEY_OPTION
@click.option("--out", required=True, type=click.Path(path_type=Path), help="the signed policy (PROOFLINE_AUTHORITY_FILE)")
def authority_sign(policy_yaml: Path, key_file: Path, out: Path) -> None:
    """Check a policy file and sign it with an approver key."""
    from proofline.authority import read_policy_yaml, sign_policy, verify_policy
    from proofline.canonical import sha256_hex
    from proofline.keys import load_keyring

    policy = read_policy_yaml(policy_yaml)
    signed = sign_policy(policy, _approver_key(key_file))
    s = settings()
    if s.keyring_file is not None:  # refuse to write what the workers would refuse to load
        verify_policy(signed, load_keyring(s.keyring_file, s.environment))
    out.write_text(json.dumps(signed, indent=2) + "\n")
    emit({"wrote": str(out), "policy_hash": sha256_hex(signed["policy"]), "version": policy.version},
         f"wrote {out} (policy version {policy.version}, hash {sha256_hex(signed['policy'])[:16]})")


@authority.command("show")
def authority_show() -> None:
    """The policy the workers load, verified against the keyring."""
    from proofline.authority import policy_in_force

    s = settings()
    loaded = policy_in_force(s)
    if loaded is None:
        emit({"policy": None}, "no authority policy configured (development: the controller's approval is the authority)")
        return
    doc = loaded.policy.model_dump(mode="json")
    emit({"policy": doc, "hash": loaded.hash, "signed_by": loaded.signed_by},
         lambda: "\n".join([f"policy version {loaded.policy.version} ({loaded.hash[:16]}), signed by {loaded.signed_by}",
                            f"default mode: {loaded.policy.default_mode.value}",
                            *(f"{name:<24} {rule.mode.value:<11} approvers {rule.approvers_required}"
                              for name, rule in sorted(loaded.policy.action_types.items()))]))


@authority.command("status")
@click.argument("action_type", required=False)
@click.option("--window-days", type=float, default=None, help="default: the policy's promotion window")
def authority_status(action_type: str | None, window_days: float | None) -> None:
    """Per action type and mode, the ledger's evidence: actions run, verified, left unresolved,
    verification failures, compensations and their success, manual resolutions; and what a
    promotion to the next rung still lacks."""
    from datetime import UTC, datetime

    from proofline.authority import Promotion, policy_in_force
    from recovery.authority_watch import evidence, shortfalls

    s = settings()
    loaded = policy_in_force(s)
    rule = loaded.policy.promotion if loaded else Promotion()
    window = timedelta(days=window_days if window_days is not None else rule.window_days)
    with connect("reader") as conn:
        rows = evidence(conn, action_type, window, datetime.now(UTC))
        current = {}
        if loaded is not None:
            from worker.authorize import effective_mode

            for name in {r["action_type"] for r in rows} | set(loaded.policy.action_types):
                mode, demoted, _ = effective_mode(conn, loaded, name)
                current[name] = {"mode": mode.value, "demoted": demoted}
    for row in rows:
        state = current.get(row["action_type"])
        row["current"] = state is not None and state["mode"] == row["mode"]
        row["promotion_lacks"] = shortfalls(row, rule) if row["current"] else []
    emit({"evidence": rows, "modes": current, "window_days": window.days},
         lambda: "\n".join([
             f"{'action type':<20} {'mode':<11} {'run':>5} {'verif':>5} {'unres':>5} {'vfail':>5} {'comp':>5} "
             f"{'cfail':>5} {'manual':>6}",
             *(f"{r['action_type']:<20} {r['mode']:<11} {r['actions']:>5} {r['verified']:>5} {r['unresolved']:>5} "
               f"{r['verification_failures']:>5} {r['compensated']:>5} {r['compensation_failed']:>5} "
               f"{r['manual_resolutions']:>6}" + ("  <- in force" if r["current"] else "") for r in rows),
             *(f"{name}: now {c['mode']}" + (f" (demoted: {c['demoted']})" if c["demoted"] else "")
               for name, c in sorted(current.items()))]) if rows or current else "no authorized action in the window")


@authority.command("promote")
@click.argument("action_type")
@click.option("--to", "to_mode", required=True, type=click.Choice(["simulate", "propose", "approved", "autonomous"]))
@KEY_OPTION
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="where to write the new signed policy (default: PROOFLINE_AUTHORITY_FILE)")
def authority_promote(action_type: str, to_mode: str, key_file: Path, out: Path | None) -> None:
    """Move an action type up to MODE, only if the ledger's evidence meets the policy's promotion
    thresholds; the new policy is signed with your approver key and the promotion is ledgered."""
    from proofline.approver import Approver

    with Approver(key_file, settings()) as approver:
        proof = approver.promote(action_type, to_mode, out)
    emit(proof, f"{action_type}: {proof['from']} -> {proof['to']} (policy version {proof['policy_version']}, "
                f"{proof['wrote']})")


@click.group()
def approvals() -> None:
    """Approvals signed by approvers: sign one for a controller to carry, revoke one, list revocations."""


@approvals.command("sign")
@click.option("--action-type", required=True)
@click.option("--tenant", required=True)
@click.option("--target", "target_json", required=True, help='JSON, e.g. {"type":"ticket","id":"T-1","expected_version":2}')
@click.option("--args", "args_json", required=True, help="the tool arguments being approved, as JSON")
@click.option("--action-id", default=None, help="approve this one action only (default: this intent)")
@click.option("--ttl-seconds", default=3600.0, show_default=True)
@click.option("--covers-irreversible", is_flag=True, help="accept that the action cannot be undone")
@click.option("--max-amount-cents", type=int, default=None)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="write the approval here (else stdout)")
@KEY_OPTION
def approvals_sign(action_type, tenant, target_json, args_json, action_id, ttl_seconds, covers_irreversible,
                   max_amount_cents, out, key_file) -> None:
    """Sign an approval of exactly these arguments on this target, for `publish --approval FILE`."""
    from proofline.approvals import ApprovalScope, sign_approval, statement_for
    from proofline.controller import prepare

    s, key = settings(), _approver_key(key_file)
    envelope = prepare(s, action_type=action_type, arguments=json_value("--args", args_json),
                       target=json_value("--target", target_json), tenant=tenant, run_id="approval",
                       action_id=action_id or "approval")
    from proofline.keys import load_keyring

    entry = load_keyring(s.keyring_file, s.environment).get(key.key_id)
    identity = (entry.identity if entry else None) or key.key_id
    statement = statement_for(envelope, approver=identity, ttl=timedelta(seconds=ttl_seconds),
                              scope=ApprovalScope(covers_irreversible=covers_irreversible,
                                                  max_amount_cents=max_amount_cents),
                              for_action=action_id is not None)
    text = json.dumps(sign_approval(statement, key), indent=2)
    if out is None:
        click.echo(text)
        return
    out.write_text(text + "\n")
    emit({"wrote": str(out), "approval_id": statement.approval_id},
         f"approval {statement.approval_id} by {identity}: {out}")


@approvals.command("revoke")
@click.argument("approval_id")
@click.option("--reason", required=True)
@click.option("--by", "who", required=True)
def approvals_revoke(approval_id: str, reason: str, who: str) -> None:
    """Revoke one approval: every action not yet sent that carries it is refused (approval_revoked)."""
    from recovery.proposals import revoke_approval

    with connect("operator") as conn:
        new = revoke_approval(conn, approval_id, who, reason)
    emit({"approval_id": approval_id, "revoked": new},
         f"approval {approval_id} {'revoked' if new else 'was already revoked'}")


@approvals.command("list")
def approvals_list() -> None:
    """Revoked approvals, newest last."""
    from recovery.proposals import list_revoked_approvals

    with connect("reader") as conn:
        rows = list_revoked_approvals(conn)
    emit_rows("revoked", rows, lambda r: f"{r['approval_id']:<32} {ts(r['revoked_at'])}  {r['revoked_by']}: {r['reason']}",
              "no approval is revoked")


@click.group()
def proposals() -> None:
    """Actions waiting for an approver (authority mode propose)."""


@proposals.command("list")
def proposals_list() -> None:
    """Every proposal, oldest first."""
    from recovery.proposals import list_proposals

    with connect("reader") as conn:
        rows = list_proposals(conn)
    emit_rows("proposals", rows, lambda r: f"{r['action_id']:<32} {r['action_type']:<18} {r['tenant']:<12} "
              f"{ts(r['proposed_at'])}  plan {dash((r['evidence'] or {}).get('plan_hash'))[:16]}  "
              f"approvals {r['approvals']}", "no action is waiting for an approver")


@proposals.command("show")
@click.argument("action_id")
def proposals_show(action_id: str) -> None:
    """A proposal's plan, and the approvals recorded so far."""
    from recovery.proposals import proposal

    with connect("reader") as conn:
        found = proposal(conn, action_id)
    plan = found["plan"] or {}
    emit(found, lambda: "\n".join([
        f"{action_id}: {found['status']} ({found['action_type']}, tenant {found['tenant']})",
        f"plan hash {dash(plan.get('plan_hash'))}  source {dash(plan.get('source'))}",
        *(["point of no return: compensation not available"] if plan.get("point_of_no_return") else []),
        *([f"outside its autonomy bounds: {plan['outside_bounds']}"] if plan.get("outside_bounds") else []),
        json.dumps(plan.get("content"), indent=2, sort_keys=True, default=str),
        *(f"approved by {a['approver']} ({a['approval_id']}) at {ts(a['recorded_at'])}" for a in found["approvals"])]))


@click.command("approve")
@click.argument("action_id")
@KEY_OPTION
@click.option("--ttl-seconds", default=3600.0, show_default=True)
@click.option("--covers-irreversible", is_flag=True, help="accept that this action cannot be undone")
@click.option("--max-amount-cents", type=int, default=None)
@click.option("--note", default="")
def approve(action_id, key_file, ttl_seconds, covers_irreversible, max_amount_cents, note) -> None:
    """Approve the exact plan a proposal waits on; it runs once enough approvers have signed."""
    from proofline.commands.operate import broker_send, dispatcher
    from recovery.proposals import approve as do_approve

    s, key = settings(), _approver_key(key_file)
    with connect("operator") as conn:
        result = broker_send(action_id, lambda: do_approve(
            s, conn, dispatcher(), action_id, key, ttl=timedelta(seconds=ttl_seconds),
            covers_irreversible=covers_irreversible, max_amount_cents=max_amount_cents, note=note))
    emit(result, f"{action_id}: approved by {result['approver']} ({len(result['approvers'])} of {result['required']})"
         + (f"; sent (task {result['task_id']})" if result["released"] else "; waiting for another approver"))


@click.command("deny")
@click.argument("action_id")
@click.option("--reason", required=True)
@click.option("--by", "who", required=True)
def deny(action_id: str, reason: str, who: str) -> None:
    """Deny a proposal: it closes as not started."""
    from recovery.proposals import deny as do_deny

    with connect("operator") as conn:
        result = do_deny(conn, action_id, who, reason)
    emit(result, f"{action_id}: denied by {who}")


COMMANDS = (authority, approvals, proposals, approve, deny)
