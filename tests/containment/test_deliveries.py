"""Delivery counts on a real Postgres: counted per message, settled by an outcome, pruned once old."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from ledger import store
from recovery.expiry import prune_deliveries_txn
from tests.conftest import create_database, drop_database
from worker import deliveries


@pytest.fixture(scope="module")
def conn() -> Iterator[psycopg.Connection]:
    admin, runtime_url = create_database("pl_deliveries")
    c = store.connect(runtime_url)  # the runtime role: what workers and the consumer use
    try:
        yield c
    finally:
        c.close()
        drop_database(admin)


def test_unsettled_deliveries_accumulate_until_an_outcome(conn: psycopg.Connection) -> None:
    key = deliveries.message_key("task-1", None)
    assert [deliveries.count(conn, key, "proofline.execute", "act-1")["unsettled"] for _ in range(3)] == [1, 2, 3]
    deliveries.note_error(conn, key, "WorkerLostError\x00")
    deliveries.settle(conn, key, "returned")
    after = deliveries.count(conn, key, "proofline.execute", None)
    assert (after["deliveries"], after["unsettled"], after["last_error"]) == (4, 1, "WorkerLostError\\x00")


def test_a_hostile_task_id_is_keyed_by_the_body() -> None:
    assert deliveries.message_key("\x00" * 300, b"body") == deliveries.message_key(None, b"body")
    assert deliveries.message_key("\x00" * 300, b"body").startswith("body:")


def test_only_old_settled_counts_are_pruned(conn: psycopg.Connection) -> None:
    for key, unsettled in (("old-settled", 0), ("old-open", 2), ("new-settled", 0)):
        deliveries.count(conn, key, "proofline.execute", None)
        with conn.cursor() as cur:
            cur.execute("UPDATE message_deliveries SET unsettled = %s, last_at = clock_timestamp() - "
                        "make_interval(secs => %s) WHERE message_key = %s",
                        (unsettled, 0 if key.startswith("new") else 7200, key))
    with store.transaction(conn) as cur:
        assert prune_deliveries_txn(cur, older_than_seconds=3600) == 1
    with conn.cursor() as cur:
        cur.execute("SELECT message_key FROM message_deliveries WHERE message_key NOT LIKE 'task:%%' ORDER BY 1")
        assert [r["message_key"] for r in cur.fetchall()] == ["new-settled", "old-open"]


def test_a_redelivery_with_no_count_also_counts_the_delivery_that_ended_unrecorded(conn: psycopg.Connection) -> None:
    """First deliveries are not counted; a message that comes back redelivered with no count yet had
    one earlier delivery that ended its process unrecorded: both are counted, then one per redelivery."""
    key = deliveries.message_key("task-redelivered", None)
    counts = [deliveries.count(conn, key, "proofline.execute", "act-2", unrecorded_before=True)["unsettled"]
              for _ in range(3)]
    assert counts == [2, 3, 4]


def test_only_a_literal_redelivered_flag_counts() -> None:
    assert deliveries.redelivered({"redelivered": True})
    assert not any(deliveries.redelivered(info) for info in (None, {}, {"redelivered": "yes"}, {"redelivered": 1},
                                                             ["redelivered"]))


def test_an_outside_kill_is_excused_up_to_the_cap(conn: psycopg.Connection) -> None:
    """A first delivery killed from outside leaves one excused delivery, so its redelivery counts
    one; each later outside kill takes one off the unsettled count, until the cap; then the death
    counts (nothing returned) and the guard sees it."""
    key = deliveries.message_key("task-killed", None)
    first = deliveries.excuse(conn, key, "proofline.execute", "act-3", cap=2)
    assert first is not None and (first["deliveries"], first["unsettled"], first["excused"]) == (1, 0, 1)
    assert deliveries.count(conn, key, "proofline.execute", "act-3", unrecorded_before=True)["unsettled"] == 1
    second = deliveries.excuse(conn, key, "proofline.execute", "act-3", cap=2)
    assert second is not None and (second["unsettled"], second["excused"]) == (0, 2)
    assert deliveries.count(conn, key, "proofline.execute", "act-3", unrecorded_before=True)["unsettled"] == 1
    assert deliveries.excuse(conn, key, "proofline.execute", "act-3", cap=2) is None
    after = deliveries.count(conn, key, "proofline.execute", "act-3", unrecorded_before=True)
    assert (after["deliveries"], after["unsettled"], after["excused"]) == (4, 2, 2)
    assert deliveries.excuse(conn, deliveries.message_key("task-none", None), "proofline.execute", None, cap=0) is None


def test_a_dead_lettered_message_is_never_excused(conn: psycopg.Connection) -> None:
    key = deliveries.message_key("task-dead", None)
    deliveries.count(conn, key, "proofline.execute", None, unrecorded_before=True)
    deliveries.mark_dead(conn, key)
    assert deliveries.excuse(conn, key, "proofline.execute", None, cap=20) is None
