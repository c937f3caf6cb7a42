"""Two migrations of one PostgreSQL server at once: roles and role memberships are cluster-wide, so
a second deployment (or a second database of a test run) migrating while the first does races it
for them. On a private embedded server, whose roles start absent, a concurrent transaction holds
the very role (then the very membership) a migration is about to create, uncommitted, until the
migration waits on it; then it commits. The migration must reach head all the same: a role's
creation tolerates the other side's (``unique_violation`` as well as ``duplicate_object``), and a
membership granted meanwhile is one PostgreSQL itself re-checks once the other side commits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from alembic.script import ScriptDirectory

from ledger.ddl import RUNTIME_ROLE
from ledger.migrate import HERE, current, upgrade
from ledger.roles import RECOVERY, WORKER

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def private_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The admin URL of a fresh embedded server's ``postgres`` database (no Proofline role yet):
    one per test, so that each starts with the roles absent."""
    from proofline_kit.embedded import start_postgres

    with ExitStack() as stack:
        admin, _, _ = start_postgres(tmp_path_factory.mktemp("race") / "pg", "postgres", stack, fresh=False)
        yield admin


def _database(admin: str, name: str) -> str:
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    parts = urlsplit(admin)
    return urlunsplit(parts._replace(path=f"/{name}"))


def _migrate_while_held(admin: str, url: str, holding: str) -> None:
    """Hold ``holding`` uncommitted on the server, migrate ``url`` until it waits on that, commit."""
    holder = psycopg.connect(admin)
    holder.execute(holding)
    failure: list[BaseException] = []

    def migrate() -> None:
        try:
            upgrade(url)
        except BaseException as exc:  # noqa: BLE001 - handed to the test below
            failure.append(exc)

    runner = threading.Thread(target=migrate, daemon=True)
    runner.start()
    database = urlsplit(url).path.lstrip("/")
    deadline = time.monotonic() + 120
    with psycopg.connect(admin, autocommit=True) as watch:
        while not watch.execute("SELECT 1 FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
                                (database,)).fetchone():
            assert runner.is_alive(), f"the migration ended without waiting on the held row: {failure}"
            assert time.monotonic() < deadline, "the migration never waited on the held row"
            time.sleep(0.05)
    holder.commit()
    holder.close()
    runner.join(120)
    assert not runner.is_alive()
    assert not failure, repr(failure[0])
    assert current(url) == ScriptDirectory(str(HERE / "migrations")).get_current_head()


def test_a_migration_that_meets_a_role_being_created_by_another_reaches_head(private_server: str) -> None:
    with psycopg.connect(private_server) as conn:
        assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (RUNTIME_ROLE,)).fetchone() is None
    url = _database(private_server, "first")
    _migrate_while_held(private_server, url, f"CREATE ROLE {RUNTIME_ROLE} LOGIN")
    with psycopg.connect(url) as conn:
        tables = conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'ledger_events'")
        assert tables.fetchone()[0] == 1


def test_a_migration_that_meets_a_membership_being_granted_by_another_reaches_head(private_server: str) -> None:
    url = _database(private_server, "second")
    with psycopg.connect(private_server, autocommit=True) as conn:
        for role in (WORKER, RECOVERY):
            if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
                conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"REVOKE {WORKER} FROM {RECOVERY}")
    _migrate_while_held(private_server, url, f"GRANT {WORKER} TO {RECOVERY}")
    with psycopg.connect(url) as conn:
        member = conn.execute("SELECT pg_has_role(%s, %s, 'MEMBER')", (RECOVERY, WORKER)).fetchone()[0]
        assert member
