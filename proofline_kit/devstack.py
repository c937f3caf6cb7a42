"""``proofline dev``: the whole single-machine stack of a deployment folder, in one terminal.

It starts an embedded PostgreSQL whose data lives in the folder (``var/pg``; kombu's SQLAlchemy
transport on it is the broker), migrates it, and runs the worker (execution and recovery in one
process, development only), beat, the operator console (with a login token printed) and the
metrics exporter, each in its own process group with its log in ``var/logs``. It writes
``var/dev.env``: the settings a second terminal loads to publish and approve against this stack.

Ctrl-C (SIGINT) or SIGTERM stops every process it started, then Postgres; a process of the stack
that exits on its own stops the rest too (``dev_stack_failed``), so nothing is left half running.
One ``proofline dev`` per folder (``var/dev.lock``; a second is refused, ``dev_already_running``).
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from urllib.request import ProxyHandler, build_opener

from ledger.migrate import upgrade
from proofline.commands.runtime import role_queues
from proofline.errors import DevAlreadyRunning, DevStackFailed
from proofline.scaffold import Layout
from proofline.settings import Settings
from proofline_kit.embedded import as_role, servers_for_this_machine, start_postgres
from proofline_kit.processes import start_process, stop_process, wait_for, wait_port_file
from proofline_kit.sor import store as sor

#: The database ``proofline dev`` keeps in the folder's embedded Postgres (kept between runs).
DATABASE = "proofline"
#: The console user ``proofline dev`` gives a fresh token at each start (an approver: it approves
#: proposals in the console with the folder's approver key).
CONSOLE_USER = "developer"
#: How long a process of the stack has to come up.
START_SECONDS = 90.0


class _Stopped(Exception):
    """SIGINT or SIGTERM arrived: stop the stack."""


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of an env file (comments and blank lines skipped; no shell expansion)."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def stack_env(layout: Layout, admin: str, runtime: str, broker: str, servers_file: Path) -> dict[str, str]:
    """The folder's .env with the embedded services in place of its service URLs, in development."""
    values = read_env_file(layout.env_file)
    values.update({
        "PROOFLINE_ENVIRONMENT": "development", "PROOFLINE_DATABASE_URL": runtime,
        "PROOFLINE_ADMIN_DATABASE_URL": admin, "PROOFLINE_BROKER_URL": broker,
        "PROOFLINE_CONTROLLER_DATABASE_URL": as_role(runtime, "proofline_controller"),
        "PROOFLINE_OPERATOR_DATABASE_URL": as_role(runtime, "proofline_operator"),
        "PROOFLINE_READER_DATABASE_URL": as_role(runtime, "proofline_reader"),
        "PROOFLINE_SERVERS_FILE": str(servers_file), "PROOFLINE_STATE_DIR": str(layout.var),
        "PROOFLINE_CONSOLE_USERS_FILE": str(layout.var / "console-users.json"),
        # One worker process runs execution and recovery here, so it holds the recovery and ledger keys.
        "PROOFLINE_RECOVERY_KEY_FILE": str(layout.key_file("recovery")),
        "PROOFLINE_LEDGER_KEY_FILE": str(layout.key_file("ledger")),
        "PROOFLINE_WORKER_KEY_FILE": str(layout.key_file("worker")),
    })
    return values


def _write_dev_env(layout: Layout, values: dict[str, str]) -> Path:
    """``var/dev.env``: what a second terminal loads (``set -a; . var/dev.env; set +a``) to publish
    as the controller and approve as the approver against the running stack."""
    path = layout.var / "dev.env"
    lines = [f"{k}={v}" for k, v in sorted({**values, "PROOFLINE_SIGNING_KEY_FILE":
                                              str(layout.key_file("controller"))}.items())]
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write("# Written by proofline dev for this run of the stack: load it in another terminal.\n")
        handle.write("\n".join(lines) + "\n")
    return path


def run_dev(directory: Path, *, console_port: int = 8470, metrics_port: int = 9465,
            say: Callable[[str], None] = print) -> int:
    """Run the stack of the deployment folder ``directory`` until SIGINT or SIGTERM."""
    layout = Layout.at(directory)
    layout.require()
    logs = layout.var / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    lock = _lock(layout)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def stop(signum: int, frame: object) -> None:
        for sig in previous:  # one signal is enough; the shutdown itself is bounded by grace periods
            signal.signal(sig, signal.SIG_IGN)
        raise _Stopped()

    for sig in previous:
        signal.signal(sig, stop)
    try:
        with ExitStack() as stack:
            say(f"proofline dev: starting Postgres in {layout.var / 'pg'} ...")
            admin, runtime, broker = start_postgres(layout.var / "pg", DATABASE, stack, fresh=False)
            upgrade(admin)
            values = stack_env(layout, admin, runtime, broker, servers_for_this_machine(
                layout.servers_file, layout.root, layout.var / "dev-servers.yaml",
                "proofline dev on a machine without bubblewrap"))
            if "SOR_DB" in values:  # the template's server: its record must exist before a call
                sor.init_db(values["SOR_DB"])
            env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")} | values
            dev_env = _write_dev_env(layout, values)
            token = _console_user(layout)
            worker_log = logs / "worker.log"
            worker_log_from = worker_log.stat().st_size if worker_log.exists() else 0  # this run's lines only
            children = _start(layout, env, console_port, metrics_port, stack)
            try:
                port = wait_port_file(layout.var / "console.port", children["console"], START_SECONDS)
                wait_for(lambda: _serves_metrics(metrics_port) or _died(children), START_SECONDS, 0.2, "the exporter")
                wait_for(lambda: _worker_ready(layout, worker_log_from) or _died(children), START_SECONDS, 0.2,
                         "the worker")
            except (RuntimeError, AssertionError) as exc:
                _check(children, layout)  # names the process that exited, with its log
                raise DevStackFailed(f"the stack did not come up: {exc}") from None
            _check(children, layout)
            say(_banner(layout, dev_env, port, metrics_port, token))
            while True:
                time.sleep(0.5)
                _check(children, layout)
    except _Stopped:
        say("proofline dev: stopped; every process it started has exited")
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(lock)  # releases the folder's lock


def _lock(layout: Layout) -> int:
    """Hold ``var/dev.lock`` while the stack runs: one ``proofline dev`` per folder. The kernel
    drops the lock when the process ends, however it ends."""
    fd = os.open(layout.var / "dev.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DevAlreadyRunning(f"proofline dev already runs the stack of {layout.root}; stop it first (Ctrl-C "
                                "in its terminal)", folder=str(layout.root)) from None
    return fd


def _console_user(layout: Layout) -> str:
    from proofline.console.access import ConsoleRole, add_user

    return add_user(layout.var / "console-users.json", CONSOLE_USER, ConsoleRole.approver,
                    layout.key_file("approver"))


def _start(layout: Layout, env: dict[str, str], console_port: int, metrics_port: int,
           stack: ExitStack) -> dict[str, subprocess.Popen]:
    proofline = [sys.executable, "-m", "proofline"]
    shards = int(env.get("PROOFLINE_TENANT_SHARDS") or Settings.model_fields["tenant_shards"].default)
    queues = role_queues("all", shards) + ",checkpoint"
    (layout.var / "console.port").unlink(missing_ok=True)
    argvs = {
        "worker": [*proofline, "worker", "--role", "all", "--queues", queues, "--concurrency", "2",
                   "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", "dev@%h"],
        "beat": [*proofline, "beat", "--schedule", str(layout.var / "beat-schedule")],
        "console": [*proofline, "console", "--port", str(console_port),
                    "--port-file", str(layout.var / "console.port")],
        "exporter": [*proofline, "exporter", "--port", str(metrics_port)],
    }
    children = {}
    for name, argv in argvs.items():
        children[name] = start_process(argv, env, layout.var / "logs" / f"{name}.log", cwd=layout.root)
        # Closed in reverse: the exporter and console first, the worker last, then Postgres.
        stack.callback(stop_process, children[name], 20.0)
    return children


def _serves_metrics(port: int) -> bool:
    """Our exporter answers on ``port`` (not merely something listening there: another program
    holding the port would make the exporter fail, and the stack must not be reported up)."""
    try:
        # Straight to loopback, whatever proxy the environment names.
        with build_opener(ProxyHandler({})).open(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
            return answer.status == 200 and b"proofline_ledger_up" in answer.read()
    except (OSError, ValueError):
        return False


def _worker_ready(layout: Layout, offset: int) -> bool:
    """Celery's own "NODE ready." line in this run's part of the worker's log: it consumes now."""
    with open(layout.var / "logs" / "worker.log", "rb") as log:
        log.seek(offset)
        return re.search(rb"\bdev@\S+ ready\.", log.read()) is not None


def _died(children: dict[str, subprocess.Popen]) -> bool:
    """Stop waiting for a port once some process has exited (``_check`` then names it)."""
    return any(proc.poll() is not None for proc in children.values())


def _check(children: dict[str, subprocess.Popen], layout: Layout) -> None:
    for name, proc in children.items():
        if proc.poll() is not None:
            log = layout.var / "logs" / f"{name}.log"
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
            raise DevStackFailed(f"the {name} process exited with {proc.returncode}; the stack was stopped. "
                                 f"Its log ({log}) ends:\n{tail}", process=name)


def _banner(layout: Layout, dev_env: Path, console_port: int, metrics_port: int, token: str) -> str:
    return "\n".join([
        "proofline dev: the stack is up (Ctrl-C stops all of it)",
        f"  console    http://127.0.0.1:{console_port}/  user {CONSOLE_USER}, token {token}",
        f"  metrics    http://127.0.0.1:{metrics_port}/metrics",
        f"  logs       {layout.var / 'logs'}",
        f"  settings   set -a; . {dev_env}; set +a   (in another terminal: publish, approve, status)",
        f"  approve    proofline approve ACTION_ID --key {layout.key_file('approver')}",
    ])
