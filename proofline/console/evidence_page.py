"""The Evidence page: an auditor opens an action's captured evidence in the console.

Only a user with the ``auditor`` role sees the page (anyone else: 403, ``console_forbidden``). The
page lists what the ledger says was captured (kinds, digests, retention, earlier reads) as the
reader role; opening the captures is a POST with the session's CSRF token, run as the auditor
database role with the auditor's private key (``PROOFLINE_AUDITOR_DATABASE_URL``,
``PROOFLINE_AUDITOR_KEY_FILE`` of the console process) through :func:`ledger.vault_store.read`,
which records ``evidence_read_by_auditor`` naming the console user, in the read's transaction.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ledger import vault_store
from proofline.auditor_keys import load_private
from proofline.commands.base import connect, settings
from proofline.console.access import AUDITOR_ONLY, CSRF_FIELD, CSRF_HEADER, authorize_write
from proofline.console.app import render
from proofline.errors import ConsoleForbidden, ProoflineError

log = logging.getLogger(__name__)


def _ledger_view(action_id: str) -> dict[str, Any]:
    """What the ledger (reader role) says was captured for the action and who read it: no values."""
    with connect("reader") as conn, conn.cursor() as cur:
        cur.execute("SELECT seq, event, actor, at, evidence FROM ledger_events WHERE action_id = %s AND event IN "
                    "(%s, %s) ORDER BY seq", (action_id, vault_store.CAPTURED, vault_store.READ))
        rows = cur.fetchall()
    captured = [dict(c, retention=r["evidence"].get("retention"), at=r["at"]) for r in rows
                if r["event"] == vault_store.CAPTURED for c in r["evidence"].get("captures", [])]
    reads = [r for r in rows if r["event"] == vault_store.READ]
    return {"captured": captured, "reads": reads}


def _refused(request: Request, refused: ConsoleForbidden) -> Response:
    log.warning("evidence page refused", extra={"event": "console_evidence_refused", "reason_code": refused.code,
                                                "path": request.url.path})
    return render(request, "refused.html", status_code=403, refused=refused)


def evidence_page(request: Request) -> Response:
    session = request.state.session
    if session.role not in AUDITOR_ONLY:
        return _refused(request, ConsoleForbidden(
            f"{session.user} is not an auditor: only an auditor may see captured evidence",
            user=session.user, role=session.role.value))
    action_id = request.path_params["action_id"]
    return render(request, "evidence.html", action_id=action_id, view=_ledger_view(action_id), opened=None,
                  problem=None)


async def evidence_open(request: Request) -> Response:
    form = await request.form()
    sent = form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER)
    try:
        session = authorize_write(request.state.session, str(sent) if sent else None, AUDITOR_ONLY)
    except ConsoleForbidden as refused:
        return _refused(request, refused)
    action_id = request.path_params["action_id"]

    def run() -> list[vault_store.Opened]:
        key = load_private(settings())
        with connect("auditor") as conn:
            return vault_store.read(conn, key, session.user, action_id=action_id, via="console")

    opened, problem = None, None
    try:
        opened = await run_in_threadpool(run)
    except ProoflineError as exc:
        problem = exc  # shown on the page: a refusal or a capture that failed authentication
    return render(request, "evidence.html", action_id=action_id, view=_ledger_view(action_id), opened=opened,
                  problem=problem)


ROUTES = [Route("/evidence/{action_id:path}", evidence_page),
          Route("/evidence/{action_id:path}", evidence_open, methods=["POST"])]
