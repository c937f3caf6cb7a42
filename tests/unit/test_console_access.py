"""The console's access rules as pure logic: the users file, logging in, and which writes are
refused before anything is read (no session, a viewer, a missing or wrong CSRF token)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from proofline.console import access
from proofline.console.access import ConsoleRole, Sessions, add_user, authorize_write, load_users
from proofline.console.reads import parse_cursor, stage_durations, stage_timeline
from proofline.errors import ConfigurationError, ConsoleForbidden, ConsoleInputInvalid, CsrfRefused


def test_the_users_file_holds_only_a_hash_of_each_token(tmp_path: Path) -> None:
    path = tmp_path / "users.json"
    token = add_user(path, "ops-alice", ConsoleRole.operator)
    assert token not in path.read_text()
    assert path.stat().st_mode & 0o077 == 0  # readable by its owner only
    users = load_users(path)
    assert users["ops-alice"].role == ConsoleRole.operator
    assert users["ops-alice"].token_sha256 == access.token_digest(token)
    again = add_user(path, "ops-alice", ConsoleRole.viewer)  # a new token replaces the old one
    assert again != token and load_users(path)["ops-alice"].role == ConsoleRole.viewer


@pytest.mark.parametrize("content, says", [
    (None, "add-user"), ("not json", "not JSON"), ('{"users": {}}', "names no user"),
    ('{"users": {"x": {"role": "admin", "token_sha256": "' + "0" * 64 + '"}}}', "needs a role"),
    ('{"users": {"x": {"role": "viewer"}}}', "token_sha256"),
])
def test_a_bad_users_file_is_a_configuration_error_that_says_why(tmp_path: Path, content: str | None,
                                                                 says: str) -> None:
    path = tmp_path / "users.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigurationError, match=says):
        load_users(path)


def test_a_user_name_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="letters, digits"):
        add_user(tmp_path / "users.json", "a b<script>", ConsoleRole.viewer)


def test_login_needs_the_right_token_and_gives_a_session_with_its_own_csrf_token(tmp_path: Path) -> None:
    path = tmp_path / "users.json"
    token = add_user(path, "ops-alice", ConsoleRole.operator)
    sessions = Sessions(load_users(path))
    assert sessions.login("ops-alice", token + "x") is None
    assert sessions.login("nobody", token) is None
    session_id, session = sessions.login("ops-alice", token)
    other_id, other = sessions.login("ops-alice", token)
    assert session_id != other_id and session.csrf != other.csrf
    assert sessions.get(session_id) == session and sessions.get("forged") is None
    sessions.logout(session_id)
    assert sessions.get(session_id) is None and sessions.get(other_id) == other


def test_an_idle_session_is_forgotten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "users.json"
    token = add_user(path, "v", ConsoleRole.viewer)
    sessions = Sessions(load_users(path))
    session_id, _ = sessions.login("v", token)
    now = access.time.monotonic()
    monkeypatch.setattr(access.time, "monotonic", lambda: now + access.SESSION_IDLE_SECONDS + 1)
    assert sessions.get(session_id) is None


def test_writes_are_refused_without_a_session_a_token_or_the_operator_role() -> None:
    operator = access.Session("ops-alice", ConsoleRole.operator, "t" * 43)
    viewer = access.Session("viewer-bob", ConsoleRole.viewer, "v" * 43)
    assert authorize_write(operator, "t" * 43) is operator
    with pytest.raises(ConsoleForbidden, match="log in first"):
        authorize_write(None, "t" * 43)
    for sent in (None, "", "u" * 43):
        with pytest.raises(CsrfRefused):
            authorize_write(operator, sent)
    with pytest.raises(ConsoleForbidden, match="viewer-bob is a viewer") as refused:
        authorize_write(viewer, "v" * 43)
    assert refused.value.code == "console_forbidden" and CsrfRefused.code == "csrf_refused"


def test_the_stage_timeline_folds_events_into_stages_with_durations() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    events = [{"seq": i + 1, "at": t0 + timedelta(milliseconds=ms), "event": name, "actor": "w", "evidence": {}}
              for i, (ms, name) in enumerate([(0, "published"), (40, "validated"), (45, "revalidated"),
                                              (50, "lease_acquired"), (300, "tool_called"),
                                              (310, "verification_enqueued"), (900, "verification_finished"),
                                              (905, "final_state")])]
    timeline = stage_timeline(events)
    assert [round(t["since_previous_ms"] or 0) for t in timeline] == [0, 40, 5, 5, 250, 10, 590, 5]
    bars = stage_durations(timeline)
    assert [(b["stage"], b["ms"]) for b in bars] == [
        ("publish", 40.0), ("validate", 5.0), ("revalidate", 5.0), ("lease", 250.0), ("call", 10.0),
        ("hand off", 590.0), ("verify", 5.0), ("settled", None)]


def test_a_page_cursor_is_one_the_console_made_or_refused() -> None:
    assert parse_cursor(None) is None and parse_cursor("") is None
    at, action_id = parse_cursor("2026-01-01T00:00:00+00:00|act-1")
    assert (at.year, action_id) == (2026, "act-1")
    for forged in ("act-1", "yesterday|act-1", "2026-01-01T00:00:00+00:00|"):
        with pytest.raises(ConsoleInputInvalid):
            parse_cursor(forged)
