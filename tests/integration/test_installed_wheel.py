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
import subprocess
import sys
import uuid
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

pytestmark = pytest.mark.timeout(420)


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment holding the built wheel and its dependencies, nothing else."""
    tmp = tmp_path_factory.mktemp("wheel")
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

        def settled() -> dict | None:
            shown = _run([proofline, "status", action_id, "--json"], env, empty, timeout=60)
            assert shown.returncode == 0, shown.stderr
            report = json.loads(shown.stdout)
            return report if report["status"] in ("closed", "escalated", "cancelled") else None

        got = wait_for(settled, 120, interval=1.0, what="the published action to settle")
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


def _console_page(port: int, user: str, token: str, path: str) -> str:
    """Log in to the console as a browser would (its login form's CSRF token and cookie), then GET ``path``."""
    opener = build_opener(HTTPCookieProcessor(http.cookiejar.CookieJar()))
    base = f"http://127.0.0.1:{port}"
    form = opener.open(f"{base}/login", timeout=30).read().decode()
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', form).group(1)
    opener.open(f"{base}/login", urlencode({"csrf_token": csrf, "user": user, "token": token}).encode(), timeout=30)
    return opener.open(f"{base}{path}", timeout=30).read().decode()
