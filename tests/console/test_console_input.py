"""Input hygiene over real HTTP against the running console: NUL bytes, control characters, broken
percent-escapes, bytes that are not UTF-8 and over-long ids, in the path, the query and a form, are
answered 400 with the console's refusal page (``console_input_invalid``), and a value Postgres
itself refuses (``psycopg.DataError``) is answered the same way, with nothing recorded."""

from __future__ import annotations

import http.client
import re
import urllib.parse
import warnings
from http.cookies import SimpleCookie
from typing import Any

import pytest

from tests.conftest import Stack
from tests.console.conftest import Console
from tests.console.test_console_writes import _escalated


class Client:
    """A cookie-keeping HTTP client that sends the path exactly as given (no re-quoting)."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.cookies: dict[str, str] = {}

    def send(self, method: str, path: str, body: bytes | None = None,
             kind: str = "application/x-www-form-urlencoded") -> tuple[int, str]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        headers = {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())}
        if body is not None:
            headers["Content-Type"] = kind
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in {**headers, "Content-Length": str(len(body or b""))}.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        for header in response.headers.get_all("Set-Cookie") or []:
            for name, morsel in SimpleCookie(header).items():
                self.cookies[name] = morsel.value
        text = response.read().decode("utf-8", "replace")
        conn.close()
        return response.status, text

    def log_in(self, console: Console, user: str) -> str:
        """Log in through the form; returns the session's CSRF token."""
        _, page = self.send("GET", "/login")
        token = re.search(r'name="csrf_token" value="([^"]+)"', page)[1]
        form = urllib.parse.urlencode({"csrf_token": token, "user": user, "token": console.tokens[user]})
        status, _ = self.send("POST", "/login", form.encode())
        assert status == 303
        _, page = self.send("GET", "/escalations")
        return re.search(r'name="csrf_token" value="([^"]+)"', page)[1]


def _refused(answer: tuple[int, str], what: str = "") -> str:
    status, page = answer
    assert status == 400, (what, status, page[:300])
    assert 'id="refused"' in page and "console_input_invalid" in page and "<h1>Refused</h1>" in page
    return re.search(r'id="refused">(.*?)</p>', page, re.S)[1]


LONG = "a" * 250
BAD_PATHS = ["/actions/abc%00", "/actions/abc%00/resolve", "/runs/r%00", "/proposals/p%00", "/actions/%zz",
             "/actions/%C3%28", "/actions/ok%FF", "/actions/a%0Ab", f"/actions/{LONG}", f"/runs/{LONG}",
             "/actions/%7F"]
#: Refused by the route itself (only a logged-in user reaches it): an age past the year 1.
ROUTE_QUERIES = ["/actions?since=99999999999999d"]
BAD_QUERIES = ["/actions?tenant=%00", "/actions?tenant=a%00b", "/actions?tenant=%ff", "/actions?tenant=%zz",
               "/actions?outcome=%C3%28", f"/actions?tenant={LONG}", "/actions?before=x%00|y", "/?minutes=1%00",
               "/actions?te%00nant=x", "/escalations?x=%1b[31m"]


@pytest.mark.parametrize("logged_in", [False, True], ids=["anonymous", "viewer"])
def test_bad_paths_and_queries_get_the_400_page(console: Console, logged_in: bool) -> None:
    client = Client(console.url)
    if logged_in:
        client.log_in(console, "viewer-bob")
    for path in [*BAD_PATHS, *BAD_QUERIES, *(ROUTE_QUERIES if logged_in else [])]:
        said = _refused(client.send("GET", path), path)
        assert "\x00" not in said and "%00" not in said, path  # the refusal echoes nothing it refused
    # The same pages with good input answer as usual.
    expected = 200 if logged_in else 303
    for path in ("/actions?tenant=ok", "/actions/no-such-action", "/?minutes=15"):
        status, _ = client.send("GET", path)
        assert status == (404 if logged_in and path.startswith("/actions/") else expected), path


def test_bad_form_fields_and_a_value_postgres_refuses_change_nothing(stack: Stack, console: Console) -> None:
    action_id = _escalated(stack)
    client = Client(console.url)
    csrf = client.log_in(console, "ops-alice")
    where = f"/actions/{action_id}/resolve"

    def form(**fields: str) -> bytes:
        return urllib.parse.urlencode({"csrf_token": csrf, "resolution": "no_effect", **fields}).encode()

    _refused(client.send("POST", where, form(reason="checked\x00")))
    _refused(client.send("POST", where, form(reason="ok", resolution="no_effect\x01")))
    _refused(client.send("POST", where, form(reason="ok", evidence="{}") + b"&reason=%E2%28"))
    _refused(client.send("POST", where, form(reason="ok") + b"&reason=%G0"))
    _refused(client.send("POST", "/switches/set", form(scope="tool", value=LONG, reason="x")))
    _refused(client.send("POST", where, b"--b\r\nContent-Disposition: form-data; name=\"reason\"\r\n\r\nx\r\n--b--\r\n",
                         kind="multipart/form-data; boundary=b"))
    assert "operator_intervention" not in stack.events(action_id)
    # A reason over several lines is free text: accepted, recorded once.
    status, _ = client.send("POST", where, form(reason="checked the queue\r\nno ticket"))
    assert status == 303
    assert stack.events(action_id).count("operator_intervention") == 1


def test_a_value_postgres_refuses_is_answered_400_not_500(stack: Stack) -> None:
    """The boundary's own mapping, in process: a route whose query Postgres refuses with a
    ``DataError`` (here a text that is not a number, against the stack's real database)."""
    import psycopg
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from proofline.console.access import SESSION_COOKIE, ConsoleRole, Sessions, User, token_digest

    # The console's app module pulls in prometheus_client, whose optional import of snappy trips an
    # import hook's ImportWarning in this interpreter (the console process itself is not affected).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImportWarning)
        from proofline.console.app import create_app

    def refused_by_postgres(request: Any) -> Any:
        with psycopg.connect(stack.env["PROOFLINE_READER_DATABASE_URL"]) as conn:
            conn.execute("SELECT %s::int", (request.query_params["n"],))
        raise AssertionError("Postgres took it")

    sessions = Sessions({"viewer": User("viewer", ConsoleRole.viewer, token_digest("t"))})
    app = create_app(sessions, "proofline_operator")
    app.router.routes.insert(0, Route("/data-error", refused_by_postgres))
    with TestClient(app, raise_server_exceptions=False) as client:
        opened = sessions.login("viewer", "t")
        assert opened is not None
        client.cookies.set(SESSION_COOKIE, opened[0])
        answer = client.get("/data-error?n=twelve", follow_redirects=False)
    assert answer.status_code == 400 and "console_input_invalid" in answer.text and "InvalidTextRepresentation" \
        in answer.text
