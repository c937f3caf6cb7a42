"""What a stack borrows from a Redis server (the session's own, or a shared one): only a database that is free and empty, and it
flushes only a database it still holds the claim on. Somebody else's keys are never touched."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from proofline_kit.resources import CLAIM_KEY, claim_redis_db, redis_url, release_redis_db


@pytest.fixture
def foreign_db() -> Iterator[tuple[int, redis.Redis, str]]:
    """A database holding a key that is not a claim (as another user's data would be). We claim it
    first so no test session of ours picks it meanwhile, then drop the claim and keep the data."""
    claim = claim_redis_db()
    client = redis.Redis.from_url(claim.url)
    other = f"someone-else:{uuid.uuid4().hex}"
    client.set(other, "precious")
    client.delete(CLAIM_KEY)
    try:
        yield claim.number, client, other
    finally:
        client.delete(other)
        client.close()


def test_a_database_with_someone_elses_keys_is_left_untouched(foreign_db) -> None:
    number, client, other = foreign_db
    with pytest.raises(RuntimeError, match="no free, empty Redis database"):
        claim_redis_db(candidates=range(number, number + 1))
    assert client.get(other) == b"precious" and client.get(CLAIM_KEY) is None


def test_release_flushes_only_while_the_claim_is_ours() -> None:
    claim = claim_redis_db()
    client = redis.Redis.from_url(claim.url)
    try:
        client.set("ours", "1")
        client.set(CLAIM_KEY, "taken-over-by-another-session")  # our claim expired and was re-claimed
        release_redis_db(claim)
        assert client.get("ours") == b"1"
        client.set(CLAIM_KEY, claim.token)
        release_redis_db(claim)
        assert client.dbsize() == 0
    finally:
        client.delete("ours", CLAIM_KEY)
        client.close()


def test_two_claims_never_share_a_database() -> None:
    first = claim_redis_db(redis_url())
    try:
        second = claim_redis_db(redis_url())
        try:
            assert first.number != second.number
        finally:
            release_redis_db(second)
    finally:
        release_redis_db(first)


def test_the_sessions_own_server_has_more_databases_than_a_shared_one_lends(session_redis: str) -> None:
    """Each test process (each xdist worker) claims on a redis-server of its own, with more
    databases than the fifteen a default server lends: twenty claims at once all succeed."""
    assert redis_url() == session_redis != "redis://127.0.0.1:6379"
    claims = []
    try:
        for _ in range(20):
            claims.append(claim_redis_db())
        assert len({c.number for c in claims}) == 20 and max(c.number for c in claims) > 15
    finally:
        for claim in claims:
            release_redis_db(claim)
