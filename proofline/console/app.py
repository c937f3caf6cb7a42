"""The console's web application (Starlette, Jinja2 templates, htmx for the live list).

Reads connect as the reader role (``PROOFLINE_READER_DATABASE_URL``), writes as the operator role
(``PROOFLINE_OPERATOR_DATABASE_URL``), one connection per request, through the same ``connect`` the
CLI uses. Every write goes through :func:`proofline.console.access.authorize_write` first, and then
through the very functions the CLI's operator commands call, so the ledger records the same events
(with the logged-in operator as who).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import click
import psycopg
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ledger.listing import ActionFilter
from proofline.commands.base import connect, dash, json_value, ts
from proofline.console import overview, reads
from proofline.console.access import (
    CSRF_FIELD,
    CSRF_HEADER,
    OPERATOR_ONLY,
    SESSION_COOKIE,
    ConsoleRole,
    Session,
    Sessions,
    authorize_write,
)
from proofline.console.hygiene import InputHygiene
from proofline.errors import (
    ConfigurationError,
    ConsoleForbidden,
    ConsoleInputInvalid,
    DatabaseUnavailable,
    NotFound,
    ProoflineError,
)

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
PAGE_SIZE = 25
#: The login form's own CSRF cookie (there is no session yet to hold the token).
LOGIN_COOKIE = "proofline_console_login"
RESOLUTIONS = ("succeeded", "failed", "no_effect", "compensated")


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, default=str, sort_keys=True)


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f} ms" if value < 10_000 else f"{value / 1000:.1f} s"


TEMPLATES = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
TEMPLATES.filters.update(ts=ts, dash=dash, pretty=_pretty, ms=_ms)


def render(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    session = request.state.session
    page = TEMPLATES.get_template(name).render(request=request, session=session, csrf_field=CSRF_FIELD,
                                               message=request.query_params.get("message"),
                                               error=request.query_params.get("error"), **context)
    return HTMLResponse(page, status_code=status_code)


def back(path: str, **params: str) -> RedirectResponse:
    return RedirectResponse(f"{path}?{urlencode(params)}" if params else path, status_code=303)


def _since(text: str | None) -> datetime | None:
    """A time-range bound from the form: an age (15m, 2h, 7d) or a datetime-local/ISO value."""
    text = (text or "").strip()
    if not text:
        return None
    units = {"m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].isdigit():
        try:
            return datetime.now(UTC) - timedelta(seconds=int(text[:-1]) * units[text[-1]])
        except OverflowError:
            raise ConsoleInputInvalid(f"{text!r} reaches back before the year 1") from None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ConsoleInputInvalid(f"{text!r} is not a time: an age (15m, 2h, 7d) or an ISO time "
                                  "(2026-11-30T21:00:00Z)") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def action_filter(request: Request) -> ActionFilter:
    q = request.query_params
    return ActionFilter(status=tuple(v for v in q.getlist("status") if v), outcome=tuple(v for v in q.getlist("outcome") if v),
                        tenant=q.get("tenant") or None, action_type=q.get("action_type") or None,
                        since=_since(q.get("since")), until=_since(q.get("until")),
                        before=reads.parse_cursor(q.get("before")))


# --- pages ------------------------------------------------------------------------------------------


def overview_page(request: Request) -> Response:
    asked = request.query_params.get("minutes", "")
    minutes = min(max(int(asked), 5), 24 * 60) if asked.isdigit() else 60
    with connect("reader") as conn, conn.cursor() as cur:
        data = overview.figures(cur, minutes)
        reader = reads.whoami(cur)
    return render(request, "overview.html", data=data, charts={k: Markup(v) for k, v in overview.charts(data).items()},
                  minutes=minutes, reader=reader, operator_role=request.app.state.operator_role)


def actions_page(request: Request) -> Response:
    flt = action_filter(request)
    limit = request.query_params.get("limit", "")
    limit = min(max(int(limit), 1), 500) if limit.isdigit() else PAGE_SIZE
    with connect("reader") as conn, conn.cursor() as cur:
        rows, cursor = reads.page_of_actions(cur, flt, limit)
        choices = reads.filter_choices(cur)
    query = [(k, v) for k, v in request.query_params.multi_items() if k != "before"]
    template = "actions_rows.html" if request.headers.get("hx-request") else "actions.html"
    return render(request, template, rows=rows, cursor=cursor, choices=choices, flt=flt,
                  query=urlencode(query), next_query=urlencode([*query, ("before", cursor)]) if cursor else None)


def _one(request: Request, param: str, read: Callable[[Any, str], dict[str, Any] | None]) -> dict[str, Any]:
    """One action or run by its id in the path, read as the reader; ``not_found`` (404) if none."""
    ident = request.path_params[param]
    with connect("reader") as conn, conn.cursor() as cur:
        detail = read(cur, ident)
    if detail is None:
        raise NotFound(f"no {param.removesuffix('_id')} {ident}", **{param: ident})
    return detail


def action_page(request: Request) -> Response:
    detail = _one(request, "action_id", reads.action_detail)
    return render(request, "action.html", d=detail, a=detail["row"], resolutions=RESOLUTIONS)


def runs_page(request: Request) -> Response:
    tenant = request.query_params.get("tenant") or None
    with connect("reader") as conn, conn.cursor() as cur:
        rows = reads.runs_page(cur, tenant, 50)
    return render(request, "runs.html", rows=rows, tenant=tenant)


def run_page(request: Request) -> Response:
    return render(request, "run.html", r=_one(request, "run_id", reads.run_detail))


def escalations_page(request: Request) -> Response:
    from recovery.operator import manual_queue

    with connect("reader") as conn:
        rows = manual_queue(conn)
    return render(request, "escalations.html", rows=rows, resolutions=RESOLUTIONS)


def switches_page(request: Request) -> Response:
    from proofline.commands.operate import SCOPES
    from recovery.operator import list_revocations, list_switches

    with connect("reader") as conn:
        switches, revoked = list_switches(conn), list_revocations(conn)
    return render(request, "switches.html", switches=switches, revoked=revoked, scopes=SCOPES)


# --- writes -----------------------------------------------------------------------------------------


async def _write(request: Request, where: str, act: Callable[[Session, Any, Any], str],
                 roles: frozenset[ConsoleRole] = OPERATOR_ONLY) -> Response:
    """Authorize (session, CSRF token, one of ``roles``), run ``act`` with the operator's connection,
    and go back to ``where`` with what happened; a refused write answers 403 and changes nothing."""
    form = await request.form()
    sent = form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER)
    try:
        session = authorize_write(request.state.session, str(sent) if sent else None, roles)
    except ConsoleForbidden as refused:
        log.warning("console write refused", extra={"event": "console_write_refused", "reason_code": refused.code,
                                                    "path": request.url.path})
        return render(request, "refused.html", status_code=403, refused=refused)
    from starlette.concurrency import run_in_threadpool

    def run() -> str:
        with connect("operator") as conn:
            return act(session, conn, form)

    try:
        done = await run_in_threadpool(run)
    except ProoflineError as exc:
        return back(where, error=f"{exc.code}: {exc.detail}")
    return back(where, message=done)


def _field(form: Any, name: str) -> str:
    return str(form.get(name) or "").strip()


def _reason(form: Any, name: str = "reason") -> str:
    text = _field(form, name)
    if not text:
        raise ConsoleInputInvalid(f"say why: the {name} is recorded in the ledger with your name")
    return text


async def resolve(request: Request) -> Response:
    action_id = request.path_params["action_id"]

    def act(session: Session, conn: Any, form: Any) -> str:
        from recovery.operator import resolve as do_resolve

        resolution = _field(form, "resolution")
        if resolution not in RESOLUTIONS:
            raise ConsoleInputInvalid(f"choose a resolution: {', '.join(RESOLUTIONS)}")
        try:  # the CLI's own parsing of `resolve --evidence`
            evidence = json_value("evidence", _field(form, "evidence") or "{}")
        except click.BadParameter as exc:
            raise ConsoleInputInvalid(f"the evidence is {exc.message}") from None
        do_resolve(conn, action_id, resolution, session.user, _reason(form), evidence)
        return f"{action_id} resolved as {resolution}"

    return await _write(request, f"/actions/{action_id}", act)


async def _sent_again(request: Request, send: Callable[..., dict[str, Any]],
                      said: Callable[[str, dict[str, Any]], str]) -> Response:
    """A write that may reach the broker (retry, cancel): ``send(conn, dispatch, action, who, why)``
    is the CLI's own function; a broker that is away leaves the recorded change in place."""
    action_id = request.path_params["action_id"]

    def act(session: Session, conn: Any, form: Any) -> str:
        from proofline.commands.operate import broker_send, dispatcher

        why = _reason(form)
        return said(action_id, broker_send(action_id, lambda: send(conn, dispatcher(), action_id, session.user, why)))

    return await _write(request, f"/actions/{action_id}", act)


async def retry(request: Request) -> Response:
    from proofline.commands.base import settings
    from recovery.operator_retry import retry_escalated

    return await _sent_again(
        request, lambda *args: retry_escalated(settings(), *args),
        lambda action_id, r: f"{action_id} sent again (call {r['calls_made'] + 1} of at most {r['calls_allowed']})")


async def cancel(request: Request) -> Response:
    from recovery.cancel import cancel as do_cancel

    return await _sent_again(
        request, do_cancel,
        lambda action_id, r: f"cancellation of {action_id} requested ({r['disposition']})" if r.get("accepted")
        else f"{action_id} is {r.get('status')}: nothing to cancel")


async def switch_set(request: Request) -> Response:
    def act(session: Session, conn: Any, form: Any) -> str:
        from proofline.commands.operate import SCOPES, engage_switch

        scope = _field(form, "scope")
        if scope not in SCOPES:
            raise ConsoleInputInvalid(f"choose a scope: {', '.join(SCOPES)}")
        value, engaged = engage_switch(conn, scope, _field(form, "value"), session.user, _reason(form),
                                       any_tenant=bool(form.get("any_tenant")))
        return f"kill switch {scope}:{value or '*'} {'set' if engaged else 'was already set'}"

    return await _write(request, "/switches", act)


async def switch_clear(request: Request) -> Response:
    def act(session: Session, conn: Any, form: Any) -> str:
        from ledger.states import KillSwitchScope
        from recovery.operator import clear_switch

        scope, value = KillSwitchScope(_field(form, "scope")), _field(form, "value")
        cleared = clear_switch(conn, scope, value, session.user, _reason(form))
        return f"kill switch {scope.value}:{value or '*'} {'cleared' if cleared else 'was not set'}"

    return await _write(request, "/switches", act)


async def revoke(request: Request) -> Response:
    def act(session: Session, conn: Any, form: Any) -> str:
        from recovery.operator import revoke as do_revoke

        identity = _field(form, "identity")
        if not identity:
            raise ConsoleInputInvalid("name the identity to revoke")
        new = do_revoke(conn, identity, session.user, _reason(form))
        return f"revoked {identity}" if new else f"{identity} was already revoked"

    return await _write(request, "/switches", act)


async def lift(request: Request) -> Response:
    def act(session: Session, conn: Any, form: Any) -> str:
        from recovery.operator import lift_revocation

        identity = _field(form, "identity")
        if not lift_revocation(conn, identity, session.user, _reason(form)):
            raise NotFound(f"{identity} is not revoked", identity=identity)
        return f"revocation of {identity} lifted"

    return await _write(request, "/switches", act)


# --- login ------------------------------------------------------------------------------------------


def login_form(request: Request) -> Response:
    # One token per browser until it logs in: a second tab (or the favicon's redirect here) must not
    # invalidate the form the first one shows.
    token = request.cookies.get(LOGIN_COOKIE) or secrets.token_urlsafe(32)
    response = render(request, "login.html", login_csrf=token)
    response.set_cookie(LOGIN_COOKIE, token, httponly=True, samesite="strict", path="/login")
    return response


async def login(request: Request) -> Response:
    form = await request.form()
    cookie = request.cookies.get(LOGIN_COOKIE)
    if not cookie or not secrets.compare_digest(cookie, str(form.get(CSRF_FIELD) or "")):
        return render(request, "refused.html", status_code=403,
                      refused=ConsoleForbidden("the login form's CSRF token is missing or wrong; reload the page"))
    opened = request.app.state.sessions.login(_field(form, "user"), _field(form, "token"))
    if opened is None:
        return back("/login", error="console_login_failed: unknown user or wrong token")
    session_id, session = opened
    log.info("console login", extra={"event": "console_login", "user": session.user, "role": session.role.value})
    response = back("/", message=f"logged in as {session.user} ({session.role.value})")
    response.set_cookie(SESSION_COOKIE, session_id, httponly=True, samesite="strict", path="/")
    response.delete_cookie(LOGIN_COOKIE, path="/login")
    return response


async def logout(request: Request) -> Response:
    form = await request.form()
    session = request.state.session
    if session is None or not secrets.compare_digest(session.csrf, str(form.get(CSRF_FIELD) or "")):
        return render(request, "refused.html", status_code=403,
                      refused=ConsoleForbidden("log out from the console's own page"))
    request.app.state.sessions.logout(request.cookies.get(SESSION_COOKIE))
    response = back("/login", message="logged out")
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


# --- the application --------------------------------------------------------------------------------

OPEN_PATHS = ("/login", "/static/", "/favicon.ico")


def create_app(sessions: Sessions, operator_role: str, approvers: dict[str, Any] | None = None) -> Starlette:
    """The application; ``approvers`` maps each approver user to its checked key
    (:func:`proofline.console.approvers.approver_keys`)."""
    # Imported here: the proposal pages use this module's helpers (render, _write).
    from proofline.console.evidence_page import ROUTES as EVIDENCE_ROUTES
    from proofline.console.proposal_pages import ROUTES as PROPOSAL_ROUTES

    routes = [*PROPOSAL_ROUTES, *EVIDENCE_ROUTES,
        Route("/", overview_page), Route("/actions", actions_page), Route("/actions/{action_id:path}/resolve",
                                                                          resolve, methods=["POST"]),
        Route("/actions/{action_id:path}/retry", retry, methods=["POST"]),
        Route("/actions/{action_id:path}/cancel", cancel, methods=["POST"]),
        Route("/actions/{action_id:path}", action_page),
        Route("/runs", runs_page), Route("/runs/{run_id:path}", run_page),
        Route("/escalations", escalations_page), Route("/switches", switches_page),
        Route("/switches/set", switch_set, methods=["POST"]), Route("/switches/clear", switch_clear, methods=["POST"]),
        Route("/revocations/add", revoke, methods=["POST"]), Route("/revocations/lift", lift, methods=["POST"]),
        Route("/login", login_form), Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]), Route("/favicon.ico", lambda request: Response(status_code=204)),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    async def who(request: Request, call_next: Any) -> Response:
        request.state.session = sessions.get(request.cookies.get(SESSION_COOKIE))
        if request.state.session is None and not request.url.path.startswith(OPEN_PATHS):
            if request.method != "GET":
                return render(request, "refused.html", status_code=403,
                              refused=ConsoleForbidden("log in first: writes need an operator session"))
            return back("/login")
        return _guarded(await call_next(request))

    def refuse(scope: dict[str, Any], exc: ConsoleInputInvalid) -> Response:
        """The 400 page for input the hygiene check refused; nothing of the request is echoed."""
        request = Request(scope)
        session = sessions.get(request.cookies.get(SESSION_COOKIE))
        log.warning("console input refused", extra={"event": "console_input_refused", "reason_code": exc.code})
        page = TEMPLATES.get_template("refused.html").render(request=request, session=session, csrf_field=CSRF_FIELD,
                                                             message=None, error=None, refused=exc)
        return _guarded(HTMLResponse(page, status_code=400))

    app = Starlette(routes=routes, exception_handlers={ProoflineError: _error_page, psycopg.DataError: _data_error},
                    middleware=[Middleware(InputHygiene, refuse=refuse), Middleware(BaseHTTPMiddleware, dispatch=who)])
    app.state.sessions = sessions
    app.state.operator_role = operator_role
    app.state.approvers = approvers or {}
    return app


def _guarded(response: Response) -> Response:
    # Pages are never framed by another site, and no script but our own runs.
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Content-Security-Policy"] = ("default-src 'self'; img-src 'self' data:; "
                                                   "style-src 'self' 'unsafe-inline'")
    response.headers["Cache-Control"] = "no-store"
    return response


async def _data_error(request: Request, exc: Exception) -> Response:
    """A value Postgres refused (``psycopg.DataError``: a NUL byte, a number out of range, text that
    is not a time) is the request's fault: the 400 page, with Postgres's class of error only."""
    log.warning("console input refused by the database", extra={"event": "console_input_refused",
                                                                 "error": type(exc).__name__})
    return await _error_page(request, ConsoleInputInvalid(f"the database cannot take a value this request sent "
                                                          f"({type(exc).__name__})"))


async def _error_page(request: Request, exc: Exception) -> Response:
    status = 404 if isinstance(exc, NotFound) else 503 if isinstance(exc, DatabaseUnavailable | ConfigurationError) \
        else 400
    return render(request, "refused.html", status_code=status, refused=exc)
