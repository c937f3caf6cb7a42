"""Redaction by value on the real stack (Postgres, Redis, Celery workers, the system of record over
stdio, Flower run as ``proofline flower``): secrets that no field name declares, written into free
text (a refund reason, a ticket title) as "the password is …", as the password of a DSN and as
well-known credential shapes, and echoed back by the system of record in every verification read.
Afterwards none of the values is in a text dump of every row of every table of the stack's
database, in the worker logs, or in what Flower's task API and task list show."""

from __future__ import annotations

import json
import secrets
import sqlite3
import string
from typing import Any

import psycopg
from psycopg import sql

from ledger.redact import MARK
from ledger.states import Outcome
from proofline_kit.sor import store as sor
from tests.conftest import Stack, wait_for
from tests.helpers import new_account
from tests.integration.test_flower_summary import RUNNING, _get, _of, _rows, _tasks, flower

__all__ = ["flower"]  # the fixture, reused: a stack whose task events a real Flower process reads


def _random(alphabet: str, size: int) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(size))


def needles() -> dict[str, str]:
    """Fresh secret values of each kind, with the characters the patterns must not stop at."""
    tricky = string.ascii_letters + string.digits + "/+=-_.@:!,;"
    b62 = string.ascii_letters + string.digits
    return {
        "said": "Pw" + _random(tricky, 18) + "9",
        "dsn": "Ds" + _random(tricky, 18) + "9",
        "github": "ghp_" + _random(b62, 36),
        "aws": "AKIA" + _random(string.ascii_uppercase + string.digits, 16),
        "jwt": "eyJ" + _random(b62, 20) + ".eyJ" + _random(b62, 30) + "." + _random(b62 + "-_", 43),
        "slack": f"xoxb-{_random(string.digits, 12)}-{_random(b62, 24)}",
    }


def ledger_dump(stack: Stack) -> str:
    """Every row of every table in every schema of the stack's database, cast to text (a bytea
    column shows as hex: the needles are searched in that form too)."""
    with psycopg.connect(stack.admin_url, autocommit=True) as conn:
        tables = conn.execute(
            """SELECT table_schema, table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE'
               AND table_schema NOT IN ('pg_catalog', 'information_schema')""").fetchall()
        assert {"actions", "ledger_events", "idempotency_records", "alembic_version"} <= {t for _, t in tables}
        parts = []
        for schema, table in tables:
            query = sql.SQL("SELECT t::text FROM {}.{} t").format(sql.Identifier(schema), sql.Identifier(table))
            parts.extend(row[0] for row in conn.execute(query))
    return "\n".join(parts)


def worker_logs(stack: Stack) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(stack.workdir.glob("worker-*.log")))


def found(values: list[str], *texts: str) -> list[str]:
    return [v for v in values for t in texts if v in t or v.encode().hex() in t]


def test_free_text_and_url_secrets_are_found_nowhere(flower: tuple[Stack, str]) -> None:
    stack, base = flower
    s = needles()
    reason = (f"refund ok'd; the password is {s['said']} and the dsn postgresql://refunds:{s['dsn']}@db-7:5432/"
              f"orders?sslmode=require, pushed with {s['github']} (jwt {s['jwt']})")
    title = f"rotate {s['aws']} and {s['slack']} from redis://:{s['dsn']}@cache:6379/0"
    account = new_account(stack)
    version = sor.get_account(stack.sor_db, account)["account"]["version"]
    refund = stack.envelope("refund.issue", arguments={"account": account, "tenant": "acme", "amount_cents": 700,
                                                       "reason": reason},
                            target={"type": "account", "id": account, "expected_version": version})
    ticket = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": title, "owner": "ops"},
                            target={"type": "ticket_queue", "id": "acme-ops"})
    for env in (refund, ticket):
        stack.publish(env)
    for env in (refund, ticket):
        row = stack.wait_settled(env.action_id, timeout=90)
        assert row.outcome == Outcome.completed_verified, (env.action_id, stack.events(env.action_id))
        assert stack.effects(env.idempotency_key) == 1
    values = list(s.values())

    # The secrets really went through: the system of record (the outside system the action writes
    # to, not Proofline's) holds them, and the sealed original the worker executed holds them.
    with sqlite3.connect(stack.sor_db) as sor_db:
        assert set(found(values, "\n".join(str(r) for r in sor_db.execute("SELECT * FROM refunds")),
                            "\n".join(str(r) for r in sor_db.execute("SELECT * FROM tickets")))) == set(values)
    assert stack.action(refund.action_id).signed_message["envelope"]["arguments"]["reason"] == reason

    # The stored copies keep the words, the DSN's scheme, user and host; the values are marks.
    stored = stack.action(refund.action_id).recovery_data["after"]["refund"]["reason"]
    assert stored == (f"refund ok'd; the password is {MARK} and the dsn postgresql://refunds:{MARK}@db-7:5432/"
                      f"orders?sslmode=require, pushed with {MARK} (jwt {MARK})")
    assert stack.action(ticket.action_id).envelope["arguments"]["title"] == \
        f"rotate {MARK} and {MARK} from redis://:{MARK}@cache:6379/0"

    dump = ledger_dump(stack)
    assert refund.action_id in dump and "postgresql://refunds:" in dump
    assert found(values, dump) == []
    logs = worker_logs(stack)
    assert "proofline.execute" in logs and refund.action_id in logs and ticket.action_id in logs
    assert found(values, logs) == []

    def shown() -> dict[str, dict[str, Any]] | None:
        tasks = _tasks(base)
        # Each action ends in a SUCCESS task: its execute task (verified inline) or a verify task.
        each = [_of(tasks, a) for a in (refund.action_id, ticket.action_id)]
        ended = all(t.get("state") not in RUNNING for ts in each for t in ts)
        return tasks if ended and all(any(t.get("state") == "SUCCESS" for t in ts) for ts in each) else None

    tasks = wait_for(shown, 60, what="Flower to see the tasks of both actions end")
    infos = [_get(f"{base}/api/task/info/{t['uuid']}") for t in _of(tasks, refund.action_id) + _of(tasks, ticket.action_id)]
    assert "proofline.execute" in {i["name"] for i in infos} and all(i.get("args") for i in infos)
    assert found(values, json.dumps(tasks), json.dumps(infos), json.dumps(_rows(base))) == []
