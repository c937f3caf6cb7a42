"""The Proposals, Approvals and Authority pages, and the writes behind them.

Approving runs :func:`recovery.proposals.approve` (what ``proofline approve`` runs) with the
approver key of the logged-in approver user, and with no other key; denying and revoking run
:func:`recovery.proposals.deny` and :func:`recovery.proposals.revoke_approval`. Who may send which
write is :mod:`proofline.console.access`'s ``APPROVER_ONLY`` and ``PROPOSAL_STOPPERS``.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proofline.commands.base import connect, settings
from proofline.console import proposal_reads
from proofline.console.access import APPROVER_ONLY, PROPOSAL_STOPPERS, Session
from proofline.console.app import _field, _reason, _write, render
from proofline.errors import ConsoleForbidden, ConsoleInputInvalid, ProoflineError


def _policy() -> tuple[Any, ProoflineError | None]:
    """The policy in force, or the reason the workers would refuse it (shown, never hidden)."""
    try:
        return proposal_reads.policy_in_force(settings()), None
    except ProoflineError as exc:
        return None, exc


def proposals_page(request: Request) -> Response:
    policy, problem = _policy()
    with connect("reader") as conn:
        rows = proposal_reads.proposals_page(conn, policy)
    return render(request, "proposals.html", rows=rows, problem=problem)


def proposal_page(request: Request) -> Response:
    policy, problem = _policy()
    with connect("reader") as conn:
        p = proposal_reads.proposal_page(conn, request.path_params["action_id"], policy)
    session: Session = request.state.session
    approver = request.app.state.approvers.get(session.user)
    return render(request, "proposal.html", p=p, problem=problem, me=approver.identity if approver else None)


def approvals_page(request: Request) -> Response:
    with connect("reader") as conn:
        revoked, recorded = proposal_reads.revoked_approvals(conn), proposal_reads.recorded_approvals(conn)
    return render(request, "approvals.html", revoked=revoked, recorded=recorded,
                  may_revoke=request.state.session.role in PROPOSAL_STOPPERS)


def authority_page(request: Request) -> Response:
    policy, problem = _policy()
    rules = sorted(policy.policy.action_types.items()) if policy else []
    return render(request, "authority.html", policy=policy, rules=rules, problem=problem)


def _cents(form: Any) -> int | None:
    text = _field(form, "max_amount_cents")
    if not text:
        return None
    if not text.isdigit():
        raise ConsoleInputInvalid(f"the largest amount is a whole number of cents, not {text[:40]!r}")
    return int(text)


async def approve(request: Request) -> Response:
    action_id = request.path_params["action_id"]

    def act(session: Session, conn: Any, form: Any) -> str:
        from proofline.commands.operate import broker_send, dispatcher
        from recovery.proposals import approve as do_approve

        approver = request.app.state.approvers.get(session.user)
        if approver is None:  # the start-up check makes this unreachable for a listed approver
            raise ConsoleForbidden(f"{session.user} has no approver key in this console", user=session.user)
        covers, cents, note = bool(form.get("covers_irreversible")), _cents(form), _field(form, "note")
        r = broker_send(action_id, lambda: do_approve(settings(), conn, dispatcher(), action_id, approver.key,
                                                      covers_irreversible=covers, max_amount_cents=cents, note=note))
        count = f"{len(r['approvers'])} of {r['required']}"
        if r["released"]:
            return f"{action_id} approved by {r['approver']} ({count}): sent to the workers"
        return f"{action_id} approved by {r['approver']} ({count}), waiting for another approver"

    return await _write(request, f"/proposals/{action_id}", act, APPROVER_ONLY)


async def deny(request: Request) -> Response:
    action_id = request.path_params["action_id"]

    def act(session: Session, conn: Any, form: Any) -> str:
        from recovery.proposals import deny as do_deny

        do_deny(conn, action_id, session.user, _reason(form))
        return f"{action_id} denied by {session.user}: it closes as not started"

    return await _write(request, f"/proposals/{action_id}", act, PROPOSAL_STOPPERS)


async def revoke_approval(request: Request) -> Response:
    def act(session: Session, conn: Any, form: Any) -> str:
        from recovery.proposals import revoke_approval as do_revoke

        approval_id = _field(form, "approval_id")
        if not approval_id:
            raise ConsoleInputInvalid("name the approval to revoke (its approval id)")
        new = do_revoke(conn, approval_id, session.user, _reason(form))
        return f"approval {approval_id} revoked" if new else f"approval {approval_id} was already revoked"

    return await _write(request, "/approvals", act, PROPOSAL_STOPPERS)


ROUTES = [
    Route("/proposals", proposals_page),
    Route("/proposals/{action_id:path}/approve", approve, methods=["POST"]),
    Route("/proposals/{action_id:path}/deny", deny, methods=["POST"]),
    Route("/proposals/{action_id:path}", proposal_page),
    Route("/approvals", approvals_page), Route("/approvals/revoke", revoke_approval, methods=["POST"]),
    Route("/authority", authority_page),
]
