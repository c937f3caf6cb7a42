"""Fixtures over ``proofline_kit.stack``: a fresh Postgres database per stack (migrated with
Alembic), a claimed Redis database, the system-of-record MCP server (stdio or streamable HTTP)
behind witness relays, and real Celery worker processes. Nothing here is mocked.

The stack builder lives in the kit so the soak and the benchmarks run without pytest; the names
tests import from here are re-exported."""

from __future__ import annotations

import compileall
import os
import socket
import time
from collections.abc import Iterator

import pytest

from proofline.settings import ROOT
from proofline_kit import zygote
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

# The xdist groups and their order (--dist loadgroup): hooks of tests/scheduling.py.
from tests.scheduling import pytest_configure, pytest_xdist_make_scheduler  # noqa: F401

# The Python processes this test process starts are forked from a preloaded zygote
# (proofline_kit/zygote.py; PROOFLINE_TEST_ZYGOTE=0 starts each one plainly).
zygote.enable()


def _compile_sources() -> None:
    """Write the bytecode of the repository's own modules once, before any test starts a process.
    The suite starts hundreds of Python processes that import them (workers, tool servers, the CLI);
    where writing bytecode is off (``PYTHONDONTWRITEBYTECODE``, as on some CI hosts) each of them
    would compile every module it imports from source again. An up-to-date file costs one stat."""
    for package in ("proofline", "worker", "ledger", "recovery", "proofline_kit", "ops", "tests"):
        compileall.compile_dir(ROOT / package, quiet=2)
    compileall.compile_file(ROOT / "celeryconfig.py", quiet=2)


if "PYTEST_XDIST_WORKER" not in os.environ:  # once, in the process that starts the others
    _compile_sources()

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


#: ``indirect`` parameters of ``stack`` for a test of broker behaviour: the same deployment on each
#: broker (Redis is the default stack's, so the suite builds it once).
ON_EACH_BROKER = [pytest.param("stdio" if name == "redis" else f"stdio/{name}", id=name) for name in BROKERS]
#: The default stack with every verification sent to the verification task
#: (``PROOFLINE_INLINE_VERIFICATION=false``), for tests of that task's own stages.
VERIFY_TASK = pytest.param("stdio+verify-task", id="verify-task")
#: What a "+MODE" suffix of a ``stack`` parameter adds to the workers' environment.
STACK_MODES = {
    "verify-task": {"PROOFLINE_INLINE_VERIFICATION": "false"},
    # A reconciler that re-drives nothing a test could still be waiting on: for a test that keeps an
    # action waiting for a scheduled retry while it does something else (the usual re-drive age is 3 s).
    "late-redrive": {"PROOFLINE_REDRIVE_AFTER_SECONDS": "600"},
}


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


#: Seconds a pooled stack may sit unused before the start of another test file tears it down.
POOL_IDLE_SECONDS = 60.0


class StackPool(dict[str, Stack]):
    """The session's stacks by variant, each built the first time a test asks for it (a worker that
    runs a stdio test, then an HTTP one, then a stdio one again reuses the first stack: pytest
    finalises a parametrised session fixture whenever the parameter changes).

    An idle stack is not free: its beat sends a reconcile sweep every second and its worker runs it
    (about 2 % of a core), and under xdist a worker may hold several variants that its later test
    files never use again. So when a test starts a new file, a stack no test has used for
    :data:`POOL_IDLE_SECONDS` is torn down; a later test that asks for it gets a new one. The variant
    pytest holds cached as the ``stack`` fixture's value (the last one it was asked for) is never
    torn down this way: pytest would hand that stack out again without asking."""

    def __init__(self) -> None:
        super().__init__()
        self.last_used: dict[str, float] = {}
        self.cached: str | None = None
        self.file: str | None = None

    def used(self, built: Stack) -> None:
        for variant, pooled in self.items():
            if pooled is built:
                self.last_used[variant] = time.monotonic()

    def reap_idle(self, file: str) -> None:
        """At the first test of a file other than the last one's: tear down the stacks idle too long."""
        if file == self.file:
            return
        self.file = file
        now = time.monotonic()
        for variant in [v for v, at in self.last_used.items()
                        if v != self.cached and v in self and now - at > POOL_IDLE_SECONDS]:
            teardown_stack(self.pop(variant))
            del self.last_used[variant]


@pytest.fixture(scope="session")
def stack_pool(session_redis: str) -> Iterator[StackPool]:
    """The session's stacks (:class:`StackPool`), torn down before the session's redis-server."""
    pool = StackPool()
    try:
        yield pool
    finally:
        for built in pool.values():
            teardown_stack(built)


@pytest.fixture(scope="session", params=["stdio"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          stack_pool: StackPool) -> Stack:
    """A running deployment with one Celery worker (two prefork processes). ``indirect``
    parametrisation with "http" gives the same deployment over streamable HTTP, "TRANSPORT/BROKER"
    on another broker (``ON_EACH_BROKER``: Redis and RabbitMQ), and a "+MODE" suffix one with the
    settings of ``STACK_MODES[MODE]`` ("+verify-task": verifications only in the verification task,
    ``VERIFY_TASK``). Each variant is kept in ``stack_pool`` while tests use it; what a test arms
    on it is cleared when the test ends (``_disarm``)."""
    variant = str(request.param)
    stack_pool.cached = variant
    if variant not in stack_pool:
        param, _, mode = variant.partition("+")
        transport, _, broker = param.partition("/")
        extra_env = STACK_MODES[mode] if mode else None
        s = build_stack(transport, tmp_path_factory.mktemp(f"stack-{transport}-{broker or 'redis'}{mode and '-' + mode}"),
                        broker=broker or "redis", extra_env=extra_env)
        try:
            start_workers(s)
        except BaseException:
            teardown_stack(s)
            raise
        stack_pool[variant] = s
    stack_pool.last_used[variant] = time.monotonic()
    return stack_pool[variant]


@pytest.fixture(autouse=True)
def _disarm(request: pytest.FixtureRequest, stack_pool: StackPool) -> Iterator[None]:
    """A test of a stack finds this process pointed at that stack: the system of record and audit
    store the controller's own reads start their stdio servers on (``build_stack`` sets them to the
    stack it built last, and a process holds several). Whatever the test armed on it (system-of-
    record faults, worker fault points, kill switches, the fault proxy's mode) is cleared when it
    ends, passed or failed. The first test of a file first lets the pool tear down its idle stacks."""
    stack_pool.reap_idle(request.node.nodeid.split("::", 1)[0])
    s: Stack | None = request.getfixturevalue("stack") if "stack" in request.fixturenames else None
    if s is not None:
        os.environ["SOR_DB"], os.environ["AUDIT_DB"] = str(s.sor_db), str(s.audit_db)
    yield
    if s is not None:
        stack_pool.used(s)
        s.disarm()
