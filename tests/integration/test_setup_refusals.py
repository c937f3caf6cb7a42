"""A worker with a bad setup refuses to start: one line naming the check, the file (and the line of a
YAML error) and the fix, exit 3 (``configuration_error``), and nothing consumed or recorded. The
same holds for ``contracts pin --check`` with a broken servers file and for the console on a port
another process holds. Real ``proofline worker`` processes against a real stack; the action
published before each attempt stays published, untouched, and a worker with a good setup runs it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ledger.states import ActionStatus
from proofline_kit import zygote
from tests.conftest import Stack, build_stack, start_workers, teardown_stack

pytestmark = pytest.mark.timeout(300)

CONFIGURATION = 3
#: The action published before any worker runs, and the number of ledger rows then.
Waiting = tuple[str, int]
#: A flow sequence left open: the parser fails at line 5, column 8 (the ``:`` after ``cwd``).
BROKEN_YAML = "servers:\n  sor:\n    transport: stdio\n    command: [python, -m\n    cwd: var\n"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    s = build_stack("stdio", tmp_path_factory.mktemp("refusals"))
    try:
        yield s
    finally:
        teardown_stack(s)


def ledger_rows(stack: Stack) -> int:
    with stack.conn.cursor() as cur:
        cur.execute("SELECT count(*) AS n FROM ledger_events")
        return cur.fetchone()["n"]


@pytest.fixture(scope="module")
def waiting(stack: Stack) -> Waiting:
    """An action on the broker before any worker runs, and the ledger's size then: each refused
    worker must leave both alone."""
    env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": "refusals", "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"})
    stack.publish(env)
    return env.action_id, ledger_rows(stack)


def run(stack: Stack, argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return zygote.run([sys.executable, "-m", "proofline", *argv], env={**stack.env, **env}, cwd=stack.workdir,
                          capture_output=True, text=True, timeout=120)


def refused(out: subprocess.CompletedProcess[str], *names: str) -> str:
    """The one line a refusal prints, after checking the exit code and the shape."""
    assert out.returncode == CONFIGURATION, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("proofline: configuration_error: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def worker(stack: Stack, **env: str) -> subprocess.CompletedProcess[str]:
    return run(stack, ["worker", "--role", "all", "--concurrency", "1", "--without-gossip", "--without-mingle"], **env)


def untouched(stack: Stack, waiting: Waiting) -> None:
    action_id, rows = waiting
    row = stack.action(action_id)
    assert row is not None and row.status == ActionStatus.published, row
    assert stack.events(action_id) == ["published"], stack.events(action_id)
    assert ledger_rows(stack) == rows  # nothing at all was written to the ledger


def test_a_broken_servers_file_is_refused_naming_its_line(stack: Stack, waiting: Waiting, tmp_path: Path) -> None:
    broken = tmp_path / "servers.yaml"
    broken.write_text(BROKEN_YAML)
    line = refused(worker(stack, PROOFLINE_SERVERS_FILE=str(broken)), str(broken), "line 5, column 8", "servers:",
                   "fix:")
    assert "refuses to start" in line
    untouched(stack, waiting)
    # doctor reads the same file the same way: its servers line names the file and the line too.
    doctor = run(stack, ["doctor"], PROOFLINE_SERVERS_FILE=str(broken))
    servers = [x for x in doctor.stdout.splitlines() if x.split()[1:2] == ["servers"]]
    assert doctor.returncode == 1 and servers and servers[0].startswith("FAIL"), doctor.stdout
    assert str(broken) in servers[0] and "line 5, column 8" in servers[0]


def test_an_authority_policy_no_approver_signed_is_refused(stack: Stack, waiting: Waiting, tmp_path: Path) -> None:
    from proofline.authority import AuthorityPolicy
    from proofline.canonical import canonical_bytes
    from proofline.keys import KeyRole, load_signing_key
    from proofline.signing import encode_signature

    # Signed with the controller's key: a document no approver signed is no policy at all.
    controller = load_signing_key(stack.settings.signing_key_file, KeyRole.controller)
    document = AuthorityPolicy(version=1).model_dump(mode="json")
    forged = tmp_path / "authority.json"
    forged.write_text(json.dumps({"policy": document, "key_id": controller.key_id,
                                  "signature": encode_signature(controller.sign(canonical_bytes(document)))}))
    refused(worker(stack, PROOFLINE_AUTHORITY_FILE=str(forged)), "authority:", "a controller key",
            "proofline authority sign")
    untouched(stack, waiting)


def test_a_servers_file_that_is_not_a_mapping_is_refused(stack: Stack, waiting: Waiting, tmp_path: Path) -> None:
    listed = tmp_path / "servers.yaml"
    listed.write_text("- sor\n- other\n")
    refused(worker(stack, PROOFLINE_SERVERS_FILE=str(listed)), str(listed), "'servers:' mapping")
    untouched(stack, waiting)


def test_no_bwrap_on_the_path_is_refused(stack: Stack, waiting: Waiting, tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    line = refused(worker(stack, PATH=str(empty)), str(stack.servers_file), "bubblewrap (bwrap) is not on PATH",
                   "apt-get install bubblewrap")
    assert "sor/write" in line
    untouched(stack, waiting)


def test_a_worker_started_by_celery_itself_refuses_without_bwrap(stack: Stack, waiting: Waiting, tmp_path: Path) -> None:
    """``celery -A worker.tasks worker`` skips the command's checks; its start-up signal runs the
    same bwrap probe."""
    empty = tmp_path / "bin"
    empty.mkdir()
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "--pool", "solo",
                          "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", "nobwrap@%h"],
                         env={**stack.env, "PATH": str(empty)}, cwd=stack.workdir, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert "refuses to start" in out.stderr and "bubblewrap (bwrap) is not on PATH" in out.stderr, out.stderr
    untouched(stack, waiting)


def test_a_bwrap_that_cannot_start_a_sandbox_is_refused(stack: Stack, waiting: Waiting, tmp_path: Path) -> None:
    """Installed is not usable: a bwrap that fails (here: no user namespaces) is refused at start,
    not found out one delivery at a time."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    line = refused(worker(stack, PATH=f"{bin_dir}:/usr/bin:/bin"), str(fake), "cannot start a sandbox here",
                   "No permissions to create new namespace")
    assert str(stack.servers_file) in line
    untouched(stack, waiting)


def test_a_missing_contracts_folder_is_refused(stack: Stack, waiting: Waiting, tmp_path: Path) -> None:
    """A folder that is not there refuses the worker; one broken file in a good folder does not (it
    refuses its own action type only: tests/integration/test_limits_stack.py starts such a worker)."""
    gone = tmp_path / "no-contracts"
    refused(worker(stack, PROOFLINE_CONTRACTS_DIR=str(gone)), "contracts:", f"{gone} is not a directory")
    untouched(stack, waiting)


def test_an_unreadable_pins_file_is_refused(stack: Stack, waiting: Waiting, tmp_path: Path) -> None:
    """A worker reads no pins, but a pins file that exists and cannot be read breaks every publish:
    a setup error. Contracts merely not pinned are not (the hostile-server stack starts with some)."""
    pins = tmp_path / "pins.json"
    pins.write_text('{"format": 1, "servers": {"sor": {"version": "1.0.0"}}}')
    refused(worker(stack, PROOFLINE_PINS_FILE=str(pins)), "pins:", str(pins), "proofline contracts pin")
    untouched(stack, waiting)


@pytest.mark.parametrize("url", ["garbage", "postgresql://proofline_runtime@127.0.0.1:5432/pl_no_such_db_here"])
def test_a_bad_database_url_is_refused(stack: Stack, waiting: Waiting, url: str) -> None:
    line = refused(worker(stack, PROOFLINE_DATABASE_URL=url), "database:", "PROOFLINE_DATABASE_URL")
    assert ("not a PostgreSQL connection URL" in line) == (url == "garbage"), line
    assert "pl_no_such_db_here" in line or url == "garbage"
    untouched(stack, waiting)


@pytest.mark.parametrize("spelling", ["prod", "Production", "production "])
def test_a_misspelled_environment_is_refused_by_the_worker_and_doctor(stack: Stack, waiting: Waiting, spelling: str) -> None:
    for argv in (["worker", "--role", "execute"], ["doctor"]):
        line = refused(run(stack, argv, PROOFLINE_ENVIRONMENT=spelling), "environment",
                       repr(spelling), "development, test, staging, production")
        assert "Traceback" not in line
    untouched(stack, waiting)


def test_production_refuses_a_broker_without_a_password_then_root(stack: Stack, waiting: Waiting,
                                                                   tmp_path: Path) -> None:
    """Production keys for a recovery process (development keys would be refused first), so the
    production rules of the environment check are what refuses."""
    keys = tmp_path / "keys"
    assert run(stack, ["keys", "generate", "--dir", str(keys)]).returncode == 0
    production = {"PROOFLINE_ENVIRONMENT": "production", "PROOFLINE_KEYS_DIR": str(keys),
                  "PROOFLINE_FAULT_POINTS_ENABLED": "false"}
    recovery = ["worker", "--role", "recovery", "--concurrency", "1"]
    refused(run(stack, recovery, **production), "environment:", "carries no password", "redis://:PASSWORD@")
    with_password = stack.broker_url.replace("redis://", "redis://:not-checked-before-start@", 1)
    assert with_password != stack.broker_url
    # doctor runs the same check and starts nothing, whoever runs this test.
    doctor = run(stack, ["doctor", "--json", "--role", "recovery"], **production, PROOFLINE_BROKER_URL=with_password)
    environment = next(c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "environment")
    assert environment["ok"] == (os.geteuid() != 0), environment
    if os.geteuid() == 0:
        assert "runs as root" in environment["detail"] and "unprivileged user" in environment["fix"]
        refused(run(stack, recovery, **production, PROOFLINE_BROKER_URL=with_password), "environment:",
                "runs as root")
    untouched(stack, waiting)


def test_doctor_and_the_worker_agree_on_a_good_setup(stack: Stack, waiting: Waiting) -> None:
    """The control: the checks pass the stack's own setup, and the waiting action, refused by
    nobody and touched by no refused worker, now runs."""
    doctor = run(stack, ["doctor", "--json"])
    assert '"name": "servers"' in doctor.stdout and "bwrap runs" in doctor.stdout, doctor.stdout
    start_workers(stack, beat=False)
    row = stack.wait_settled(waiting[0])
    assert row.status == ActionStatus.closed, row


def test_pin_check_with_a_broken_servers_file_is_a_configuration_error(stack: Stack, tmp_path: Path) -> None:
    broken = tmp_path / "servers.yaml"
    broken.write_text(BROKEN_YAML)
    refused(run(stack, ["contracts", "pin", "--check"], PROOFLINE_SERVERS_FILE=str(broken)), str(broken),
            "line 5, column 8")


def test_the_console_on_a_port_in_use_is_a_configuration_error(stack: Stack, tmp_path: Path) -> None:
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        users = tmp_path / "users.json"
        assert run(stack, ["console", "add-user", "ops", "--role", "operator", "--users", str(users)]).returncode == 0
        line = refused(run(stack, ["console", "--port", str(port), "--users", str(users)]), f"127.0.0.1:{port}",
                       "PROOFLINE_CONSOLE_PORT")
        assert "in use" in line
    finally:
        holder.close()
