"""The claim transaction checks that the session still holds the action's advisory locks.

A worker takes both locks in one round trip, then talks to MCP servers before it claims. If its
session ended meanwhile (idle past the lease TTL, terminated, or replaced by the process), the locks
went with it and another worker may hold them now: the lease row must not be written.
"""

from __future__ import annotations

import pytest

from ledger import store
from proofline.errors import LeaseBusy
from tests.conftest import create_database, drop_database
from worker.lease import Locks, action_lock_name, target_lock_name, try_lock_and_read, write_lease_txn


def test_the_lease_is_written_only_by_the_session_that_holds_the_locks() -> None:
    admin, _ = create_database("pl_locks")
    locks = Locks(action_lock_name("act-locks"), target_lock_name("acme", "account", "acct-1"))
    first, second = store.connect(admin), store.connect(admin)
    try:
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
        try_lock_and_read(second, locks)
        with store.transaction(second) as cur:
            assert write_lease_txn(cur, "act-locks", locks.target, "w2", 4.0, locks) > token
    finally:
        first.close()
        second.close()
        drop_database(admin)
