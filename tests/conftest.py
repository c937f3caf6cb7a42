"""Fixtures over ``proofline_kit.stack``: a fresh Postgres database per stack (migrated with
Alembic), a claimed Redis database, the system-of-record MCP server (stdio or streamable HTTP)
behind witness relays, and real Celery worker processes. Nothing here is mocked.

The stack builder lives in the kit so the soak and the benchmarks run without pytest; the names
tests import from here are re-exported."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from proofline.settings import ROOT
from proofline_kit.processes import start_process, stop_process, wait_for, wait_port
from proofline_kit.redis_server import RedisServer
from proofline_kit.resources import (
    ADMIN_URL,
    CLAIM_KEY,
    DB_ROLES,
    REDIS_URL_VARIABLE,
    claim_redis_db,
    create_database,
    create_vhost,
    delete_vhost,
    drop_database,
    redis_url,
    release_redis_db,
    role_urls,
    with_database,
)
from proofline_kit.stack import (
    BROKERS,
    CANARY_SECRET,
    SETTLED,
    Stack,
    build_stack,
    start_workers,
    teardown_stack,
)

__all__ = ["ADMIN_URL", "BROKERS", "CANARY_SECRET", "ON_EACH_BROKER", "CLAIM_KEY", "DB_ROLES", "ROOT", "SETTLED", "Stack", "VERIFY_TASK",
           "build_stack", "claim_redis_db", "create_database", "drop_database", "free_port", "redis_url", "release_redis_db",
           "role_urls", "start_process", "start_workers", "stop_process", "teardown_stack", "wait_for", "wait_port",
           "with_database"]


def free_port() -> int:
    """A port that was free a moment ago. Only for a client-side listener a test starts in its
    own process right after; a server the stack starts binds port 0 and reports its port instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` (the README's command) a test file runs on one xdist worker, so
    the stacks its module-scoped fixtures build are built once; a test marked ``xdist_group`` keeps
    the group it names. Without xdist the marks change nothing."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


#: ``indirect`` parameters of ``stack`` for a test of broker behaviour: the same deployment on each
#: broker (Redis is the default stack's, so the suite builds it once).
ON_EACH_BROKER = [pytest.param("stdio" if name == "redis" else f"stdio/{name}", id=name) for name in BROKERS]
#: The default stack with every verification sent to the verification task
#: (``PROOFLINE_INLINE_VERIFICATION=false``), for tests of that task's own stages.
VERIFY_TASK = pytest.param("stdio+verify-task", id="verify-task")


#: Databases of the session's own redis-server: a process under xdist holds a few stacks at once,
#: and tests that build their own stacks claim more.
SESSION_REDIS_DATABASES = 64


@pytest.fixture(scope="session", autouse=True)
def session_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of this test process's own (each xdist worker has one), on a port it could
    bind, that every stack of the session claims its database on: parallel workers, and other test
    sessions on the machine, never compete for the shared server's fifteen databases. Set
    ``PROOFLINE_TEST_REDIS_URL`` to claim on a server of your choosing instead."""
    if os.environ.get(REDIS_URL_VARIABLE):
        yield redis_url()
        return
    server = RedisServer(tmp_path_factory.mktemp("session-redis"), databases=SESSION_REDIS_DATABASES).start()
    os.environ[REDIS_URL_VARIABLE] = server.base_url
    try:
        yield server.base_url
    finally:
        os.environ.pop(REDIS_URL_VARIABLE, None)
        server.stop()


@pytest.fixture(params=BROKERS)
def broker_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A broker of the test's own with nothing on it, on each broker in turn: a claimed Redis
    database, or a fresh RabbitMQ virtual host; emptied and given up afterwards."""
    if request.param == "redis":
        claim = claim_redis_db()
        try:
            yield claim.url
        finally:
            release_redis_db(claim)
    else:
        vhost = create_vhost()
        try:
            yield vhost.url
        finally:
            delete_vhost(vhost)


@pytest.fixture(scope="session", params=["stdio"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A running deployment with one Celery worker (two prefork processes). ``indirect``
    parametrisation with "http" gives the same deployment over streamable HTTP, "TRANSPORT/BROKER"
    on another broker (``ON_EACH_BROKER``: Redis and RabbitMQ), and a "+verify-task" suffix one that
    verifies only in the verification task (``VERIFY_TASK``)."""
    param, _, mode = str(request.param).partition("+")
    transport, _, broker = param.partition("/")
    # "+verify-task": every verification is its own task (no verdict from the execute task's own read).
    extra_env = {"PROOFLINE_INLINE_VERIFICATION": "false"} if mode == "verify-task" else None
    s = build_stack(transport, tmp_path_factory.mktemp(f"stack-{transport}-{broker or 'redis'}{mode and '-' + mode}"),
                    broker=broker or "redis", extra_env=extra_env)
    try:
        start_workers(s)
        yield s
    finally:
        teardown_stack(s)


@pytest.fixture(autouse=True)
def _disarm(request: pytest.FixtureRequest) -> Iterator[None]:
    """Whatever a test armed on the shared stack (system-of-record faults, worker fault points,
    kill switches, the fault proxy's mode) is cleared when it ends, passed or failed."""
    yield
    if "stack" in request.fixturenames:
        s: Stack = request.getfixturevalue("stack")
        s.disarm()
