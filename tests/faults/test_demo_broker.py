"""The demo's broker: kombu's SQLAlchemy transport on the ledger's own Postgres (what
``proofline demo`` runs when no broker is configured), driven with a real worker process.

One refund goes through it with its response dropped after the system of record applied it, and
its signed message is delivered a second time through the same broker: the action is verified
from the system of record, the refund exists once, and the broker's own tables show the messages
were carried (and consumed) by Postgres, not by Redis.
"""

from __future__ import annotations

import sys
import uuid

import psycopg
from celery import Celery

from ledger.migrate import sqlalchemy_url
from ledger.states import ActionStatus, Outcome
from proofline_kit.sor import store as sor
from tests.conftest import build_stack, start_process, teardown_stack, wait_for
from tests.helpers import new_account, refund_env


def test_action_through_the_sqlalchemy_broker(tmp_path) -> None:
    s = build_stack("stdio", tmp_path)
    # The broker needs to create its tables, so it connects as the database owner (as the demo does).
    broker = "sqla+" + sqlalchemy_url(s.admin_url)
    s.env["PROOFLINE_BROKER_URL"] = broker
    redis_app, s.app = s.app, Celery("proofline-test-controller-sqla", broker=broker)
    s.app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True)
    redis_app.close()
    try:
        argv = [sys.executable, "-m", "proofline", "worker", "--role", "all", "--concurrency", "2",
                "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", f"sqla-{uuid.uuid4().hex[:6]}@%h"]
        s.workers.append(start_process(argv, s.env, tmp_path / "worker-sqla.log"))

        def queues() -> list[str]:
            with psycopg.connect(s.admin_url) as conn:
                if conn.execute("SELECT to_regclass('kombu_queue')").fetchone()[0] is None:
                    return []
                return [r[0] for r in conn.execute("SELECT name FROM kombu_queue")]

        wait_for(lambda: any(q.startswith("actions") for q in queues()) and s.workers_alive(), 60,
                 what="the worker to declare its queues in Postgres")

        env = refund_env(s, new_account(s), timeout_seconds=1.0)
        sor.set_fault(s.sor_db, "issue_refund", "drop_response", remaining=1, delay_seconds=20)
        try:
            s.publish(env)
            wait_for(lambda: s.effects(env.idempotency_key) == 1, 30, what="the refund to be applied")
            s.deliver(s.message(env))  # the same signed message again, through the same broker
            row = s.wait_settled(env.action_id, timeout=90)
        finally:
            sor.clear_faults(s.sor_db, "issue_refund")
        assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
        calls = [e["evidence"] for e in s.timeline(env.action_id) if e["event"] == "tool_called"]
        assert [c["outcome"] for c in calls] == [Outcome.unknown_outcome.value]
        # The second delivery was handled: suppressed or reconciled, never called again.
        wait_for(lambda: {"duplicate_suppressed", "redelivery_ignored", "redelivery_reenqueued_verification",
                          "reconcile_required"} & set(s.events(env.action_id)), 30,
                 what="the second delivery to be recorded")
        assert s.effects(env.idempotency_key) == 1
        assert s.events(env.action_id).count("tool_called") == 1
        # The server was handed the refund once, and its answer never came back.
        [call] = s.witness.calls(key=env.idempotency_key)
        assert call.tool == "issue_refund" and call.arguments_sha256 == env.arguments_hash

        with psycopg.connect(s.admin_url) as conn:
            carried = dict(conn.execute(
                "SELECT q.name, count(*) FILTER (WHERE NOT m.visible) AS consumed FROM kombu_message m "
                "JOIN kombu_queue q ON q.id = m.queue_id GROUP BY q.name").fetchall())
            waiting = conn.execute("SELECT count(*) FROM kombu_message WHERE visible").fetchone()[0]
        # Both execute deliveries and the verification went through Postgres and were consumed.
        assert sum(n for q, n in carried.items() if q.startswith("actions")) == 2, carried
        assert sum(n for q, n in carried.items() if q.startswith("verify")) >= 1, carried
        assert waiting == 0
    finally:
        teardown_stack(s)
