"""The production rules that look at the host and its services (proofline/production_checks.py),
through the real ``proofline worker`` and ``proofline doctor`` commands.

- A runtime role that Postgres lets in with a wrong password (this machine's Postgres is ``trust``)
  is refused; a role behind ``scram-sha-256`` (a private embedded Postgres) passes.
- A Redis that answers an unauthenticated PING (this machine's) is refused; a private one with
  ``requirepass`` passes. A RabbitMQ reached as guest, or accepting guest/guest, is refused.
- An execute worker that can read another role's key file is refused by permission, although its
  settings name no such file; its own key open to group or others is refused too.

Production refuses root before any of these, and the tests run as root: the worker and doctor run
in a forked process that has dropped to ``nobody`` (the interpreter's modules are loaded before the
fork, since this machine's Python lives in a folder nobody may not enter)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import psycopg
import pytest

from proofline.scaffold import Layout, init
from proofline_kit.redis_server import RedisServer

pytestmark = pytest.mark.timeout(300)

NOBODY = 65534
CONFIGURATION = 3
#: This machine's services: Postgres with trust authentication, Redis without a password.
TRUST_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
OPEN_REDIS = "redis://:a-password-it-never-asks-for@127.0.0.1:6379/0"


def run_cli(argv: list[str], env: dict[str, str], cwd: Path, uid: int | None = None) -> tuple[int, str, str]:
    """``proofline ARGV`` in a forked process with only ``env``, as ``uid`` when given: exit code,
    stdout, stderr."""
    from proofline.settings import get_settings

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 99
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - flushed before _exit
                sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
                os.environ.clear()
                os.environ.update(env)
                get_settings.cache_clear()
                os.chdir(cwd)
                if uid is not None:
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
                from proofline.cli import main

                main.main(argv, prog_name="proofline")
                code = 0
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else 1
            except BaseException:  # noqa: BLE001 - shown to the test, which fails on it
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()


def refusal(result: tuple[int, str, str], check: str, *parts: str) -> str:
    code, _, err = result
    lines = err.strip().splitlines()
    assert code == CONFIGURATION and len(lines) == 1, (code, err)
    assert lines[0].startswith(f"proofline: configuration_error: the worker refuses to start: {check}: "), lines[0]
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def doctor_checks(result: tuple[int, str, str]) -> dict[str, dict]:
    code, out, err = result
    assert code in (0, 1) and "Traceback" not in err, (code, err)
    return {c["name"]: c for c in json.loads(out)["checks"]}


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    """A folder nobody may enter (0755), holding a ``proofline init`` deployment whose worker and
    seal key folders belong to nobody, as they would to the worker's own system user."""
    root = Path(tempfile.mkdtemp(prefix="pl-production-"))
    root.chmod(0o755)
    try:
        layout = init(root / "deployment")
        for role in ("worker", "seal"):
            for path in (layout.key_file(role).parent, layout.key_file(role)):
                os.chown(path, NOBODY, NOBODY)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def closed_redis(folder: Path) -> Iterator[RedisServer]:
    work = folder / "redis"
    work.mkdir()
    server = RedisServer(work, password="s3cret-for-the-test").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def scram_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A role with a password on a private Postgres whose pg_hba.conf asks it for one."""
    from proofline_kit.embedded import start_postgres

    with ExitStack() as stack:
        admin, _, _ = start_postgres(tmp_path_factory.mktemp("scram") / "pg", "checks", stack, fresh=True)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("DROP ROLE IF EXISTS pl_with_password")
            conn.execute("CREATE ROLE pl_with_password LOGIN PASSWORD 'right-password'")
            hba = Path(conn.execute("SHOW hba_file").fetchone()[0])
            hba.write_text("local all postgres trust\nlocal all all scram-sha-256\n"
                           "host all all 127.0.0.1/32 scram-sha-256\n")
            conn.execute("SELECT pg_reload_conf()")
        socket_dir = admin.split("host=", 1)[1].split("&", 1)[0]
        yield f"postgresql://pl_with_password:right-password@/checks?host={socket_dir}"


def production(folder: Path, **settings: str) -> dict[str, str]:
    """An execute worker's settings as ``proofline init`` writes them (worker.env plus .env's keys)."""
    layout = Layout.at(folder / "deployment")
    return {"PATH": os.environ["PATH"], "PROOFLINE_ENVIRONMENT": "production",
            "PROOFLINE_KEYRING_FILE": str(layout.keyring), "PROOFLINE_WORKER_KEY_FILE": str(layout.key_file("worker")),
            "PROOFLINE_SEAL_KEY_FILE": str(layout.key_file("seal")), "PROOFLINE_BROKER_URL": OPEN_REDIS,
            "PROOFLINE_DATABASE_URL": TRUST_URL, **settings}


def execute_worker(folder: Path, **settings: str) -> tuple[int, str, str]:
    return run_cli(["worker", "--role", "execute", "--concurrency", "1"], production(folder, **settings), folder,
                   uid=NOBODY)


@pytest.fixture(scope="module", autouse=True)
def _loaded(folder: Path) -> None:
    """Load every module the checks import before any fork drops to nobody (see the module's note)."""
    import encodings.idna  # noqa: F401 - socket code encodes host names with it, on first use

    import amqp  # noqa: F401
    import kombu.transport.pyamqp  # noqa: F401
    import redis  # noqa: F401

    run_cli(["doctor", "--json", "--role", "execute"], production(folder), folder)
    run_cli(["doctor", "--json"], production(folder, PROOFLINE_BROKER_URL="amqp://u:p@127.0.0.1:5672//"), folder)


def test_an_execute_worker_that_can_read_the_controller_key_is_refused(folder: Path) -> None:
    """Nothing in the worker's settings names the controller key: the permission is what counts."""
    controller = Layout.at(folder / "deployment").key_file("controller")
    controller.parent.chmod(0o755)
    controller.chmod(0o644)
    try:
        refusal(execute_worker(folder), "key-files", "execute process (uid 65534)",
                f"can read the controller key {controller}", "mode 0644", "chmod 700 keys/ROLE")
    finally:
        controller.chmod(0o600)
        controller.parent.chmod(0o700)
    # Closed again, the same worker passes this check and is refused by the next (this machine's Redis).
    refusal(execute_worker(folder), "broker-auth")


def test_a_key_of_its_own_role_open_to_its_group_is_refused(folder: Path) -> None:
    """The key a worker loads must be 0600 (the keys check); so must any other key of its role it
    can read, such as one left behind by a rotation."""
    left = Layout.at(folder / "deployment").key_file("worker").with_name("worker-2026-11.key")
    shutil.copyfile(Layout.at(folder / "deployment").key_file("worker"), left)
    os.chown(left, NOBODY, NOBODY)
    left.chmod(0o640)
    try:
        refusal(execute_worker(folder), "key-files", f"its own worker key {left} is open to group or others",
                "mode 0640")
    finally:
        left.unlink()


def test_a_redis_that_answers_without_a_password_is_refused(folder: Path) -> None:
    """The broker URL carries a password, so the URL rule passes; the server never asks for it."""
    refusal(execute_worker(folder), "broker-auth", "the Redis at 127.0.0.1:6379 answers PING without a password",
            "requirepass")


def test_a_database_role_let_in_with_a_wrong_password_is_refused(folder: Path, closed_redis: RedisServer) -> None:
    refusal(execute_worker(folder, PROOFLINE_BROKER_URL=closed_redis.url), "db-auth",
            "PROOFLINE_DATABASE_URL (postgres@127.0.0.1:5432/postgres) in with a wrong password (trust authentication)",
            "scram-sha-256")


def test_doctor_runs_the_same_checks_and_passes_what_is_closed(folder: Path, closed_redis: RedisServer,
                                                               scram_url: str) -> None:
    # As nobody: its own keys only, a Redis that asks for its password.
    found = doctor_checks(run_cli(["doctor", "--json", "--role", "execute"],
                                  production(folder, PROOFLINE_BROKER_URL=closed_redis.url), folder, uid=NOBODY))
    assert found["environment"]["ok"] and found["key-files"]["ok"], found
    assert found["broker-auth"]["ok"] and "refuses an unauthenticated PING" in found["broker-auth"]["detail"], found
    assert not found["db-auth"]["ok"] and "trust authentication" in found["db-auth"]["detail"], found
    # As root (the test's own user): root reads every key, and the scram role's login passes.
    found = doctor_checks(run_cli(["doctor", "--json", "--role", "execute"],
                                  production(folder, PROOFLINE_DATABASE_URL=scram_url,
                                             PROOFLINE_BROKER_URL=closed_redis.url), folder))
    assert found["db-auth"]["ok"] and "a wrong password is refused for 1 role URL" in found["db-auth"]["detail"], found
    assert not found["environment"]["ok"] and "runs as root" in found["environment"]["detail"]
    assert not found["key-files"]["ok"] and "can read the approver key" in found["key-files"]["detail"]
    # ... and the controller, ledger, recovery and auditor (private) keys
    assert "(and 4 more)" in found["key-files"]["detail"], found["key-files"]["detail"]
    # Outside production the same findings are reported, never failed.
    found = doctor_checks(run_cli(["doctor", "--json", "--role", "execute"],
                                  production(folder, PROOFLINE_ENVIRONMENT="staging"), folder))
    assert found["key-files"]["ok"] and "would be refused in production" in found["key-files"]["detail"], found
    assert found["db-auth"]["ok"] and "production only" in found["db-auth"]["detail"], found


@pytest.mark.parametrize(("url", "says"), [("amqp://guest:guest@127.0.0.1:5672//", "as RabbitMQ's default guest"),
                                           ("amqp://proofline:pw@127.0.0.1:5672//",
                                            "accepts the default guest/guest login"),
                                           # a cluster's list: every node is checked, not only the first
                                           # (nothing answers on the first, so it cannot be judged)
                                           ("amqp://proofline:pw@127.0.0.2:1//;amqp://guest:guest@127.0.0.1:5672//",
                                            "logs in to 127.0.0.1:5672 as RabbitMQ's default guest")])
def test_a_rabbitmq_reached_as_guest_or_accepting_guest_is_refused(folder: Path, url: str, says: str) -> None:
    found = doctor_checks(run_cli(["doctor", "--json", "--role", "execute"],
                                  production(folder, PROOFLINE_BROKER_URL=url), folder))
    assert not found["broker-auth"]["ok"] and says in found["broker-auth"]["detail"], found
    assert "rabbitmqctl delete_user guest" in found["broker-auth"]["fix"]
