"""A pre-call refusal of an action an earlier delivery already claimed goes to verification.

The earlier holder claimed the idempotency record, moved the action to ``executing`` and died
before (or while) calling; then a kill switch was engaged. The next delivery's revalidation fails.
Closing the action as not started is what the ledger refuses from ``executing`` (and what the
earlier holder's call may make untrue): in a 2,000-item soak that delivery retried for ever and the
action never settled. Now the delivery takes the lease under a new token, marks the record unknown
and hands the action to verification; a record proven to have made no effect closes it as failed
before any side effect. Rows are planted in a migrated database (triggers off for the planting);
the delivery's writes run as the worker role, through the ledger's guarded transitions.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ledger import store
from ledger.redact import POLICY
from ledger.states import ActionStatus, IdempotencyStatus, Outcome
from proofline_kit.resources import role_urls
from tests.conftest import create_database, drop_database
from worker.execute import _close_before_effect
from worker.lease import Locks, action_lock_name, target_lock_name, try_lock_and_read

AID, KEY, TENANT = "a-claimed", "k-claimed", "acme"
PLANT = """
INSERT INTO actions (action_id, run_id, tenant, action_type, server, tool, idempotency_key, status, envelope,
                     deadline)
VALUES (%(aid)s, 'run-1', %(tenant)s, 'service.restart', 'sor', 'restart_service', %(key)s, 'executing',
        '{}'::jsonb, now() + interval '1 hour');
INSERT INTO idempotency_records (key, action_id, tenant, argument_hash, contract_hash, status, fencing_token,
                                 expires_at)
VALUES (%(key)s, %(aid)s, %(tenant)s, 'h', 'c', %(record)s, nextval('lease_fencing_seq'), now() + interval '1 day');
INSERT INTO leases (action_id, target_key, owner_host, owner_pid, worker_id, fencing_token, expires_at)
VALUES (%(aid)s, 'proofline:target:acme:service:svc-1', 'gone', 1, 'worker-gone', currval('lease_fencing_seq'),
        now() - interval '1 minute');
"""


class Dispatched:
    def __init__(self) -> None:
        self.verified: list[str] = []
        self.settled_ids: list[str] = []

    def verify(self, action_id: str, tenant: str | None = None) -> None:
        self.verified.append(action_id)

    def settled(self, conn: Any, actor: str, action_id: str, **known: Any) -> None:
        self.settled_ids.append(action_id)


@pytest.mark.parametrize(("record", "expected"), [
    ("in_progress", (ActionStatus.verifying, Outcome.unknown_outcome, "reconcile_required", "unknown")),
    ("failed", (ActionStatus.closed, Outcome.failed_before_side_effect, "kill_switch_engaged", "failed")),
])
def test_a_refused_redelivery_of_a_claimed_action_settles(record: str, expected: tuple) -> None:
    admin, _ = create_database("pl_refused_claim")
    try:
        with store.connect(admin) as conn, conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
            for statement in PLANT.strip().split(";\n"):
                conn.execute(statement, {"aid": AID, "key": KEY, "tenant": TENANT, "record": record})
        envelope = SimpleNamespace(action_id=AID, idempotency_key=KEY, tenant=TENANT,
                                   target=SimpleNamespace(type="service", id="svc-1"))
        dispatch = Dispatched()
        with store.connect(role_urls(admin)["worker"]) as conn:
            rt = SimpleNamespace(conn=conn, settings=SimpleNamespace(worker_id="worker-2", lease_ttl_seconds=4.0))
            locks = Locks(action_lock_name(AID), target_lock_name(TENANT, "service", "svc-1"))
            try_lock_and_read(conn, locks, hold=True)  # this delivery holds both locks, as _execute does
            _close_before_effect(rt, envelope, POLICY, [("validated", {})], "revalidation_failed",
                                 {"reason_code": "kill_switch_engaged"}, "kill_switch_engaged", Outcome.not_started,
                                 dispatch)
            held = conn.execute("SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' "
                                "AND pid = pg_backend_pid()").fetchone()
        assert held is not None and held["n"] == 0  # the locks went with the commit
        with store.connect(admin) as conn:
            row = conn.execute("SELECT status, outcome, reason_code FROM actions WHERE action_id = %s",
                               (AID,)).fetchone()
            idem = conn.execute("SELECT status::text AS status, fencing_token FROM idempotency_records").fetchone()
            lease = conn.execute("SELECT released_at, fencing_token FROM leases").fetchone()
            events = [r["event"] for r in conn.execute("SELECT event FROM ledger_events WHERE action_id = %s "
                                                       "ORDER BY seq", (AID,)).fetchall()]
        status, outcome, reason, record_after = expected
        assert (row["status"], row["outcome"], row["reason_code"]) == (status.value, outcome.value, reason)
        assert idem["status"] == record_after == IdempotencyStatus(record_after).value
        assert lease["released_at"] is not None and lease["fencing_token"] > 1  # taken over, then released
        assert events[:2] == ["validated", "revalidation_failed"]
        assert ("reconcile_required" in events) is (record == "in_progress")
        assert dispatch.verified == ([AID] if status == ActionStatus.verifying else [])
        assert dispatch.settled_ids == ([AID] if status == ActionStatus.closed else [])
    finally:
        drop_database(admin)
