"""Envelope builders and ledger readers shared by the integration and fault tests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from ledger.redact import scrub_text
from proofline.envelope import Envelope
from proofline_kit.sor import store as sor
from recovery.runs import load_steps
from tests.conftest import Stack, wait_for

#: The timestamp Celery writes at the head of each worker log line.
_CELERY_LOG_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}):")


def log_stamp(line: str) -> datetime | None:
    """When a Celery worker log line was written (the worker's own clock), None for any other line."""
    stamp = _CELERY_LOG_STAMP.match(line)
    return datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f") if stamp else None


def uid() -> str:
    """A unique string of digits that the ledger stores as it is: the monotonic clock in ns is 13
    digits for the machine's first hours of uptime, and about one in ten of those the ledger's
    redaction takes for a card number and masks (a test comparing it with a stored event would then
    fail on that run only); such a value is skipped."""
    while True:
        value = str(time.monotonic_ns())
        if scrub_text(value) == value:
            return value


def ticket_env(stack: Stack, **kw: Any) -> Envelope:
    return stack.envelope("ticket.create", arguments={"tenant": "acme", "title": f"t-{uid()}", "owner": "ops"},
                          target={"type": "ticket_queue", "id": "acme-ops"}, **kw)


def evidence_of(stack: Stack, action_id: str, event: str) -> list[dict[str, Any]]:
    """The evidence of every ``event`` on an action's chain, in order."""
    return [e["evidence"] for e in stack.timeline(action_id) if e["event"] == event]


def failed_reads(stack: Stack, action_id: str) -> int:
    """How many precondition reads of an action failed so far: repeats of one cause are counted on
    the action, not recorded as events (worker/read_waits.py)."""
    row = stack.action(action_id)
    causes = ((row.recovery_data if row else {}) or {}).get("read_failures", {}).get("causes", {})
    return sum(int(c.get("count", 0)) for c in causes.values())


def new_account(stack: Stack, balance: int = 100_000) -> str:
    name = f"acct-{uid()}"
    sor.put_account(stack.sor_db, name, "acme", balance)
    return name


def refund_env(stack: Stack, account: str, amount: int = 1200, **kw: Any) -> Envelope:
    version = sor.get_account(stack.sor_db, account)["account"]["version"]
    return stack.envelope("refund.issue",
                          arguments={"account": account, "tenant": "acme", "amount_cents": amount, "reason": "sla"},
                          target={"type": "account", "id": account, "expected_version": version}, **kw)


def refund_under_fault(stack: Stack, env: Envelope, mode: str, remaining: int) -> Any:
    """Publish ``env`` with the system of record's ``issue_refund`` fault ``mode`` armed; the settled row."""
    sor.set_fault(stack.sor_db, "issue_refund", mode, remaining=remaining)
    try:
        stack.publish(env)
        return stack.wait_settled(env.action_id, timeout=60)
    finally:
        sor.clear_faults(stack.sor_db, "issue_refund")


def restart_env(stack: Stack, **kw: Any) -> Envelope:
    """A restart of a service of its own (created for the test), at its current generation."""
    name = f"svc-{uid()}"
    sor.put_service(stack.sor_db, name, "acme")
    gen = sor.get_service(stack.sor_db, name)["generation"]
    return stack.envelope("service.restart", arguments={"service": name, "tenant": "acme", "expected_generation": gen},
                          target={"type": "service", "id": name, "expected_version": gen}, **kw)


def stale_close_env(stack: Stack, **kw: Any) -> Envelope:
    ticket = sor.put_ticket(stack.sor_db, "acme", "to close", "ops")
    version = sor.get_ticket(stack.sor_db, ticket)["ticket"]["version"]
    env = stack.envelope("ticket.close", arguments={"ticket_id": ticket, "expected_version": version},
                         target={"type": "ticket", "id": ticket, "expected_version": version}, **kw)
    sor.bump_version(stack.sor_db, "ticket", ticket)  # changed after approval: this step cannot start
    return env


def run_of(stack: Stack, builders: list) -> list[Envelope]:
    run_id, n = f"run-{uid()}", len(builders)
    return [build(run_id=run_id, action_id=f"{run_id}-s{i}", step=i, run_steps=n) for i, build in enumerate(builders)]


def recovery_action(stack: Stack, action_id: str) -> str:
    published = [e for e in stack.timeline(action_id) if e["event"] == "recovery_action_published"]
    assert published, f"no recovery action for {action_id}: {stack.events(action_id)}"
    return published[0]["evidence"]["recovery_action"]


def run_settled(stack: Stack, run_id: str, expect: str | None = None) -> dict[str, Any]:
    """The run's ``run_settled`` evidence once it is recorded. With ``expect``, an outcome other than
    that one fails with what each step saw and did (its chain, its target as the system of record
    holds it now), so that a failure on a loaded machine explains itself."""
    def settled():
        events = [e for e in stack.timeline(f"run:{run_id}") if e["event"] == "run_settled"]
        return events[0]["evidence"] if events else None

    def where() -> str:
        with stack.conn.cursor() as cur:
            steps = load_steps(cur, run_id)
        return f"run {run_id} to settle; where its steps stood:\n" + "\n".join(
            _step_story(stack, s.action_id) for s in steps)

    # A run is several actions in a row (its steps, then any compensations), each of which may take
    # a single action's wait (Stack.wait_settled, 120 s) on a loaded machine; one minute for the
    # whole run was outlasted there. The wait ends at the event; only a failure waits it out.
    summary = wait_for(settled, 300, what=where)
    if expect is not None and summary["outcome"] != expect:
        raise AssertionError(f"run {run_id} settled {summary['outcome']!r}, not {expect!r}\n"
                             + "\n".join(_step_story(stack, s["action_id"]) for s in summary["steps"]))
    return summary


def _step_story(stack: Stack, action_id: str) -> str:
    """A step's story (``Stack.story``) and its target as the system of record holds it now."""
    row = stack.action(action_id)
    target = row.envelope.get("target", {}) if row is not None else {}
    now = sor.get_ticket(stack.sor_db, target["id"]) if target.get("type") == "ticket" else None
    return f"{stack.story(action_id)}\n  target={json.dumps(target)} now={json.dumps(now, default=str)}"


class LosingBroker:
    """A dispatcher whose broker loses every message: the ledger records the publication, the
    queue never sees it."""

    def __init__(self) -> None:
        self.lost: list[dict[str, Any]] = []

    def execute(self, message: dict[str, Any], queue: str = "actions", task_id: str | None = None) -> str:
        self.lost.append(message)
        return task_id or ""


def sor_processes(stack: Stack, role: str | None = None) -> list[psutil.Process]:
    """The stdio system-of-record servers the workers spawned (``role``: writer or reader only),
    not the sh/bwrap processes that sandbox them nor the witness relay wrapping each."""
    found = []
    for worker in stack.workers:
        for child in psutil.Process(worker.pid).children(recursive=True):
            try:
                # The witness relay names the server in its argv: not a server itself.
                cmdline = " ".join(child.cmdline())
                if ("proofline_kit.sor" in cmdline and "proofline_kit.witness" not in cmdline
                        and child.name().startswith("python")
                        and (role is None or child.environ().get("SOR_ROLE") == role)):
                    found.append(child)
            except psutil.NoSuchProcess:
                continue
    return found


def settled_by_cli(proofline: str, action_id: str, env: dict[str, str], cwd: Path | None = None) -> dict[str, Any]:
    """``proofline status ACTION --json`` once the action is closed, escalated or cancelled (as a
    user would poll it, through the installed command)."""
    def settled() -> dict[str, Any] | None:
        shown = subprocess.run([proofline, "status", action_id, "--json"], env=env, cwd=cwd, capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        report = json.loads(shown.stdout)
        return report if report["status"] in ("closed", "escalated", "cancelled") else None

    return wait_for(settled, 120, interval=0.5, what=f"action {action_id} to settle")


@contextmanager
def embedded_postgres_dir() -> Iterator[Path]:
    """A scratch folder for a test that runs ``proofline dev`` (its embedded Postgres in it), made
    outside pytest's temporary tree. Run as root, the embedded-postgres library starts the server as
    its own system user and opens every folder above the data to traversal (o+rx); a pytest session
    starting meanwhile (another checkout's) closes ``/tmp/pytest-of-root`` to 0700 again, and the
    server would then fail to start ("could not access directory ... Permission denied")."""
    path = Path(tempfile.mkdtemp(prefix="proofline-dev-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
