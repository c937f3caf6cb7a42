"""A folder ``proofline init`` made, run as its systemd units run it, against real services.

Only the lines the tutorial marks ``CHANGE`` are edited (the service URLs in ``.env`` and
``recovery.env``, and the ports); the processes are started with the units' own ``ExecStart``
lines and ``EnvironmentFile`` files: an execute worker, a recovery worker, beat, the console and the
exporter on real Postgres and Redis. They run as ``staging``: production also refuses a process
running as root and a broker URL without a password (``proofline/setup_checks.py``), and this
machine's tests run as root against a password-less Redis. Staging keeps everything else the same
(the files, the keys each process holds, the signed policy); tests/unit/test_init_scaffold.py
checks the production key rules of the same folder. An action the controller
publishes with ``controller.env`` is proposed by the scaffolded policy, approved with the
scaffolded approver key, and verified.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.request import ProxyHandler, build_opener

import pytest

from proofline.scaffold import UNITS, init
from proofline_kit.devstack import read_env_file
from proofline_kit.processes import start_process, stop_process, unused_port, wait_for, wait_port
from proofline_kit.resources import (
    claim_redis_db,
    create_database,
    drop_database,
    release_redis_db,
    role_urls,
)
from tests.helpers import settled_by_cli

pytestmark = pytest.mark.timeout(600)  # 105 s on a slow day; the limit only ends a hang

PUBLISH = """
import json
from proofline import Client
with Client() as client:
    handle = client.publish("ticket.create", tenant="acme", target={"type": "ticket_queue", "id": "acme-ops"},
                            arguments={"tenant": "acme", "title": "from the units", "owner": "ops"})
    print(json.dumps({"action_id": handle.action_id, "status": handle.wait(timeout=120).status.value}))
"""


def _change(path: Path, values: dict[str, str]) -> None:
    """Set the ``KEY=`` lines named in ``values``, as a person editing the file would."""
    text = path.read_text()
    for key, value in values.items():
        text, count = re.subn(rf"^{key}=.*$", f"{key}={value}", text, flags=re.M)
        assert count == 1, key
    path.write_text(text)


def _unit(folder: Path, name: str) -> tuple[list[str], list[Path]]:
    """A unit's command line and environment files."""
    lines = (folder / "systemd" / f"proofline-{name}.service").read_text().splitlines()
    argv = next(line for line in lines if line.startswith("ExecStart=")).removeprefix("ExecStart=").split()
    return argv, [Path(line.removeprefix("EnvironmentFile=")) for line in lines if line.startswith("EnvironmentFile=")]


def _get(url: str) -> str:
    try:
        with build_opener(ProxyHandler({})).open(url, timeout=5) as answer:
            return answer.read().decode()
    except OSError:
        return ""


def _env(files: list[Path]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "SOR_"))}
    for path in files:
        env.update(read_env_file(path))
    return env


def test_the_units_of_an_init_folder_run_an_action_on_real_services(tmp_path: Path) -> None:
    layout = init(tmp_path / "deploy", approver="ops-lead@example.com")
    admin, _ = create_database("pl_units")
    urls = role_urls(admin)
    claim = claim_redis_db()
    _change(layout.env_file, {"PROOFLINE_DATABASE_URL": urls["worker"], "PROOFLINE_ADMIN_DATABASE_URL": admin,
                              "PROOFLINE_CONTROLLER_DATABASE_URL": urls["controller"],
                              "PROOFLINE_OPERATOR_DATABASE_URL": urls["operator"],
                              "PROOFLINE_READER_DATABASE_URL": urls["reader"], "PROOFLINE_BROKER_URL": claim.url})
    _change(layout.root / "recovery.env", {"PROOFLINE_DATABASE_URL": urls["recovery"]})
    console_port, metrics_port = unused_port(), unused_port()
    _change(layout.env_file, {"PROOFLINE_CONSOLE_PORT": str(console_port)})  # the test's free ports
    assert read_env_file(layout.env_file)["PROOFLINE_ENVIRONMENT"] == "production"  # what init writes
    _change(layout.env_file, {"PROOFLINE_ENVIRONMENT": "staging"})
    extra = {"worker": ["--without-mingle", "--without-gossip"], "recovery": ["--without-mingle", "--without-gossip"],
             "exporter": ["--port", str(metrics_port)]}  # the last --port is the one click takes
    # The console serves its users only: the first one is made as the tutorial makes it.
    added = subprocess.run([str(layout.proofline), "console", "add-user", "ops", "--role", "operator"],
                           env=_env([layout.env_file]), capture_output=True, text=True, timeout=60)
    assert added.returncode == 0, added.stdout + added.stderr
    processes = []
    try:
        for name in UNITS:
            argv, files = _unit(layout.root, name)
            processes.append(start_process([*argv, *extra.get(name, [])], _env(files), tmp_path / f"{name}.log",
                                           cwd=layout.root))
        try:
            wait_port(console_port, 60)
        except AssertionError:
            raise AssertionError((tmp_path / "console.log").read_text()[-3000:]) from None
        wait_for(lambda: "proofline_ledger_up 1.0" in _get(f"http://127.0.0.1:{metrics_port}/metrics"), 60,
                 interval=0.5, what="the exporter to read the ledger")
        controller = _env([layout.env_file, layout.root / "controller.env"])
        published = subprocess.run([sys.executable, "-c", PUBLISH], env=controller, cwd=tmp_path,
                                   capture_output=True, text=True, timeout=180)
        assert published.returncode == 0, published.stderr[-3000:]
        proposal = json.loads(published.stdout.strip().splitlines()[-1])
        assert proposal["status"] == "proposed", (proposal, (tmp_path / "worker.log").read_text()[-3000:])

        operator = _env([layout.env_file])
        approved = subprocess.run([str(layout.proofline), "approve", proposal["action_id"], "--key", str(layout.key_file("approver"))],
                                  env=operator, capture_output=True, text=True, timeout=120)
        assert approved.returncode == 0, approved.stdout + approved.stderr

        got = settled_by_cli(str(layout.proofline), proposal["action_id"], operator)
        assert (got["status"], got["outcome"]) == ("closed", "completed_verified"), \
            (tmp_path / "worker.log").read_text()[-3000:]
        for name, proc in zip(UNITS, processes, strict=True):
            assert proc.poll() is None, (name, (tmp_path / f"{name}.log").read_text()[-3000:])
    finally:
        for proc in processes:
            stop_process(proc)
        release_redis_db(claim)
        drop_database(admin)
