"""The soak's ``no_advisory_locks`` invariant on a real PostgreSQL: a lock held across both of its
looks is reported; a transaction-scoped lock in use at the first look and gone by the second (a
quiet fleet's periodic sweep) is not."""

from __future__ import annotations

import random
import time

import psycopg
import pytest
from psycopg.rows import dict_row

from ops import soak_check
from tests.conftest import ADMIN_URL


def test_a_lock_held_at_both_looks_is_reported_and_one_in_use_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    held_key, passing_key = random.sample(range(1_000_000, 2_000_000_000), 2)
    seen_first: set[int] = set()
    with psycopg.connect(ADMIN_URL, autocommit=True, row_factory=dict_row) as checker, \
            psycopg.connect(ADMIN_URL, autocommit=True) as holder, psycopg.connect(ADMIN_URL) as sweeper:
        holder.execute("SELECT pg_advisory_lock(%s)", (held_key,))
        sweeper.execute("SELECT pg_advisory_xact_lock(%s)", (passing_key,))  # its transaction stays open
        oid = checker.execute("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()["oid"]
        real_sleep = time.sleep

        def between_the_looks(seconds: float) -> None:
            # Between the checker's two looks: what it saw first, then the sweep's transaction ends.
            seen_first.update(r["objid"] for r in checker.execute(
                "SELECT objid FROM pg_locks WHERE locktype = 'advisory' AND database = %s", (oid,)).fetchall())
            sweeper.commit()
            real_sleep(seconds)

        monkeypatch.setattr(soak_check.time, "sleep", between_the_looks)
        reported = soak_check.held_advisory_locks(checker.cursor(), oid, interval=0.2)
    assert {held_key, passing_key} <= seen_first
    objids = {r["objid"] for r in reported}
    assert held_key in objids
    assert passing_key not in objids
