"""The claim transaction checks that the session still holds the action's advisory locks.

A worker takes both locks in one round trip, then talks to MCP servers before it claims. If its
session ended meanwhile (idle past the lease TTL, terminated, or replaced by the process), the locks
went with it and another worker may hold them now: the lease row must not be written.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from ledger import store
from proofline.errors import LeaseBusy, StaleLease
from tests.conftest import create_database, drop_database, wait_for
from worker.lease import (
    Heartbeat,
    Locks,
    action_lock_name,
    target_lock_name,
    try_lock_and_read,
    write_lease_txn,
)


@pytest.fixture
def sessions() -> Iterator[tuple[psycopg.Connection, psycopg.Connection]]:
    """Two sessions on a new migrated database, closed (and the database dropped) afterwards."""
    admin, _ = create_database("pl_locks")
    first, second = store.connect(admin), store.connect(admin)
    try:
        yield first, second
    finally:
        first.close()
        second.close()
        drop_database(admin)


def test_the_lease_is_written_only_by_the_session_that_holds_the_locks(sessions) -> None:
    first, second = sessions
    locks = Locks(action_lock_name("act-locks"), target_lock_name("acme", "account", "acct-1"))
    try_lock_and_read(first, locks)
    with store.transaction(first) as cur:
        token = write_lease_txn(cur, "act-locks", locks.target, "w1", 4.0, locks)
    # Another session never took the locks: it may not write the lease.
    with pytest.raises(LeaseBusy) as refused, store.transaction(second) as cur:
        write_lease_txn(cur, "act-locks", locks.target, "w2", 4.0, locks)
    assert refused.value.context["which"] == "lost"
    first.close()  # the holder's session ends, and its locks with it
    with pytest.raises(LeaseBusy), store.transaction(second) as cur:
        write_lease_txn(cur, "act-locks", locks.target, "w2", 4.0, locks)
    # Once it has taken them itself, it may, and the fencing token moves on.
    take_when_freed(second, locks)
    with store.transaction(second) as cur:
        assert write_lease_txn(cur, "act-locks", locks.target, "w2", 4.0, locks) > token


def test_the_lease_never_takes_an_older_token_and_an_old_holder_cannot_renew_it(sessions) -> None:
    """Two fences behind the locks: the row keeps the newest token even against a writer that holds
    the locks, and a heartbeat renews only under its own token (a holder whose lease was taken over
    learns it on its next beat, before it sends anything)."""
    first, second = sessions
    locks = Locks(action_lock_name("act-tokens"), target_lock_name("acme", "account", "acct-2"))
    try_lock_and_read(first, locks)
    with store.transaction(first) as cur:
        old = write_lease_txn(cur, "act-tokens", locks.target, "w1", 4.0, locks)
    stale = Heartbeat(first, "act-tokens", old, ttl=4.0, interval=1.0)
    assert stale._renew() and not stale.lost.is_set()
    first.close()
    take_when_freed(second, locks)
    with store.transaction(second) as cur:
        new = write_lease_txn(cur, "act-tokens", locks.target, "w2", 4.0, locks)
    assert new > old
    # Even the lock holder cannot write an older token over a newer one.
    with pytest.raises(StaleLease), store.transaction(second) as cur:
        write_lease_txn(cur, "act-tokens", locks.target, "w1", 4.0, locks, token=old)
    # The old holder's beat (on a live session) moves nothing and reports the lease lost.
    beat = Heartbeat(second, "act-tokens", old, ttl=4.0, interval=1.0)
    assert not beat._renew() and beat.lost.is_set()
    with second.cursor() as cur:
        cur.execute("SELECT fencing_token, worker_id FROM leases WHERE action_id = 'act-tokens'")
        assert cur.fetchone() == {"fencing_token": new, "worker_id": "w2"}
    assert Heartbeat(second, "act-tokens", new, ttl=4.0, interval=1.0)._renew()


def take_when_freed(conn, locks: Locks) -> None:
    """Take the locks once the closed holder's backend has exited: a closed connection's session
    ends asynchronously, so for a moment its locks may still show as held."""

    def taken() -> bool:
        try:
            try_lock_and_read(conn, locks)
        except LeaseBusy:
            return False
        return True

    wait_for(taken, 10, what="the closed session's locks to be freed")
