"""``proofline dev`` from the checkout: SIGTERM stops the whole stack, and a process of the stack
that cannot start stops the rest (``dev_stack_failed``), a second ``proofline dev`` on the same
folder is refused (``dev_already_running``); none of them leaves a process behind,
embedded Postgres included. (The installed wheel, an action through it and SIGINT:
tests/integration/test_installed_wheel.py.)"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from proofline.scaffold import init
from proofline_kit import zygote
from proofline_kit.processes import start_process, stop_process, unused_port, wait_for
from tests.helpers import embedded_postgres_dir

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def scratch() -> Iterator[Path]:
    with embedded_postgres_dir() as path:
        yield path


def _dev(folder: Path, log: Path, metrics_port: int):
    return start_process([sys.executable, "-m", "proofline", "dev", "--dir", str(folder), "--console-port",
                          str(unused_port()), "--metrics-port", str(metrics_port)],
                         _env(), log, cwd=folder)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")}


def _postgres(folder: Path) -> psutil.Process | None:
    """The embedded Postgres of ``folder`` while it runs (its ``postmaster.pid``)."""
    try:
        return psutil.Process(int((folder / "var" / "pg" / "postmaster.pid").read_text().split()[0]))
    except (OSError, ValueError, IndexError, psutil.NoSuchProcess):
        return None


def _left(processes: list[psutil.Process]) -> list[tuple[int, str]]:
    """Those of ``processes`` still alive (Postgres' postmaster is not dev's child: it is given here).
    One that ends while it is being looked at is gone, not left."""
    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append((p.pid, p.name()))
        except psutil.NoSuchProcess:
            continue
    return left


def test_sigterm_stops_every_process_of_the_stack(scratch: Path) -> None:
    folder = init(scratch / "deploy").root
    log = scratch / "dev.log"
    dev = _dev(folder, log, unused_port())
    try:
        wait_for(lambda: "the stack is up" in log.read_text() or (dev.poll() is not None and pytest.fail(log.read_text())),
                 180, interval=0.3, what="proofline dev to come up")
        tree = psutil.Process(dev.pid).children(recursive=True)
        assert len(tree) >= 4, [p.cmdline() for p in tree]
        postgres = _postgres(folder)
        assert postgres is not None and postgres.is_running()
        # A second dev on the same folder is refused before it starts anything (it would share
        # this Postgres and stop it on its way out); the first one runs on.
        second = zygote.run([sys.executable, "-m", "proofline", "dev", "--dir", str(folder)], env=_env(),
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 3 and "dev_already_running" in second.stderr, second.stdout + second.stderr
        assert dev.poll() is None and all(p.is_running() for p in tree)
        dev.send_signal(signal.SIGTERM)
        assert dev.wait(120) == 0, log.read_text()[-3000:]
        assert "every process it started has exited" in log.read_text()
        assert _left([*tree, postgres]) == []
    finally:
        stop_process(dev)


def test_a_process_that_cannot_start_stops_the_stack_with_dev_stack_failed(scratch: Path) -> None:
    folder = init(scratch / "deploy").root
    log = scratch / "dev.log"
    with socket.socket() as taken:  # the metrics port is taken: the exporter cannot listen
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        dev = _dev(folder, log, taken.getsockname()[1])
        try:
            tree: list[psutil.Process] = []
            postgres: list[psutil.Process] = []

            def exited() -> bool:
                if dev.poll() is None:
                    try:
                        children = psutil.Process(dev.pid).children(recursive=True)
                    except psutil.NoSuchProcess:  # dev ended between poll() and this read
                        children = []
                    tree.extend(p for p in children if p not in tree)
                    server = _postgres(folder)
                    postgres.extend([server] if server is not None and server not in postgres else [])
                return dev.poll() is not None

            wait_for(exited, 180, interval=0.2, what="proofline dev to give up")
        finally:
            stop_process(dev)
    shown = log.read_text()
    assert dev.returncode == 3, shown[-3000:]
    assert "dev_stack_failed" in shown and "the exporter process exited" in shown, shown[-3000:]
    assert "the stack is up" not in shown
    assert postgres, "Postgres was never seen running: the stack failed before the exporter could"
    assert _left([*tree, *postgres]) == []
