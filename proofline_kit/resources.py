"""Shared services a stack borrows a piece of: a Postgres database it creates (and only that one is
ever dropped), a Redis database it claims (and only a claimed one is ever flushed), or a RabbitMQ
virtual host it creates (and only that one is ever deleted).

A Redis database is claimed with ``SET NX`` of :data:`CLAIM_KEY` holding a token unique to the claim,
and used only if the claim key is all it holds: a database with anybody else's keys in it is
released untouched and the next one is tried. Releasing flushes the database only while the claim
key still holds our token.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis

from ledger.migrate import upgrade

ADMIN_URL = os.environ.get("PROOFLINE_TEST_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
#: The variable naming the Redis server stacks claim databases on; the test session sets it to a
#: private ``redis-server`` of its own (tests/conftest.py), so parallel sessions never share one.
REDIS_URL_VARIABLE = "PROOFLINE_TEST_REDIS_URL"
#: The shared server, when nothing names another.
SHARED_REDIS_URL = "redis://127.0.0.1:6379"
#: The RabbitMQ node the tests create virtual hosts on (``rabbitmqctl`` must reach it: run as root
#: or as the rabbitmq user).
RABBITMQ_URL = os.environ.get("PROOFLINE_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672")
#: RabbitMQ's own scripts (the Debian/Ubuntu package), for private nodes (``proofline_kit/rabbitmq_server.py``).
RABBITMQ_SCRIPTS = Path(os.environ.get("PROOFLINE_TEST_RABBITMQ_SCRIPTS", "/usr/lib/rabbitmq/bin"))

#: The database roles migrations 0003 and 0018 create (short name -> role), and the development role.
DB_ROLES = {"controller": "proofline_controller", "worker": "proofline_worker", "recovery": "proofline_recovery",
            "operator": "proofline_operator", "reader": "proofline_reader", "runtime": "proofline_runtime",
            "auditor": "proofline_auditor"}


def redis_url() -> str:
    """The Redis server (no database number) claims are made on, read at each claim: a session that
    starts its own server after this module was imported is still the one claimed from."""
    return os.environ.get(REDIS_URL_VARIABLE, SHARED_REDIS_URL)


def with_database(url: str, dbname: str, user: str | None = None) -> str:
    """The same server URL (TCP or unix socket) for another database and, optionally, user."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if user is not None:
        netloc = f"{user}@{netloc.rsplit('@', 1)[-1]}" if "@" in netloc else f"{user}@{netloc}"
    return urlunsplit((parts.scheme, netloc, f"/{dbname}", parts.query, parts.fragment))


def create_database(prefix: str, maintenance_url: str = ADMIN_URL) -> tuple[str, str]:
    """A new, migrated database; returns (admin url, runtime-role url). ``role_urls`` gives the rest."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(maintenance_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    admin = with_database(maintenance_url, name)
    upgrade(admin)
    return admin, with_database(maintenance_url, name, user="proofline_runtime")


def role_urls(admin_url: str) -> dict[str, str]:
    """The URL of each database role (``DB_ROLES`` keys) for the database ``admin_url`` names."""
    name = urlsplit(admin_url).path.lstrip("/")
    return {short: with_database(admin_url, name, user=role) for short, role in DB_ROLES.items()}


def drop_database(admin_url: str) -> None:
    """Drop the database ``admin_url`` names (one :func:`create_database` made)."""
    name = urlsplit(admin_url).path.lstrip("/")
    with psycopg.connect(with_database(admin_url, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


CLAIM_KEY = "proofline:test-claim"
#: A claim outlives any test session; an abandoned one frees its database after this long.
CLAIM_SECONDS = 3 * 3600


@dataclass(frozen=True)
class RedisClaim:
    """A Redis database this process claimed: its broker URL and the token that proves the claim."""

    url: str
    number: int
    token: str


def database_count(base_url: str) -> int:
    """How many databases the server has (``CONFIG GET databases``; 16, Redis's default, when the
    server does not say)."""
    client = redis.Redis.from_url(base_url)
    try:
        return int(client.config_get("databases").get("databases", 16))
    except (redis.ResponseError, ValueError):  # CONFIG renamed or disabled on a managed server
        return 16
    finally:
        client.close()


def claim_redis_db(base_url: str | None = None, candidates: range | None = None) -> RedisClaim:
    """The first candidate database (by default every one but 0 that ``base_url``, or
    :func:`redis_url`, has) that is free (no claim key) and empty, claimed for this process."""
    base_url = base_url or redis_url()
    if candidates is None:
        candidates = range(1, database_count(base_url))
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
    for number in candidates:
        url = f"{base_url}/{number}"
        client = redis.Redis.from_url(url)
        try:
            if not client.set(CLAIM_KEY, token, nx=True, ex=CLAIM_SECONDS):
                continue
            if client.dbsize() == 1:
                return RedisClaim(url, number, token)
            _unclaim(client, token)  # somebody's data lives here: leave it exactly as it was
        finally:
            client.close()
    raise RuntimeError(f"no free, empty Redis database among {list(candidates)} at {base_url}")


def _unclaim(client: redis.Redis, token: str) -> bool:
    """Delete the claim key if it still holds ``token`` (atomically); True when it did."""
    script = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
    return bool(client.eval(script, 1, CLAIM_KEY, token))


def release_redis_db(claim: RedisClaim) -> None:
    """Empty the claimed database and give it up, only while the claim is still ours."""
    client = redis.Redis.from_url(claim.url)
    try:
        script = ("if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('FLUSHDB') return 1 end return 0")
        client.eval(script, 1, CLAIM_KEY, claim.token)
    finally:
        client.close()


@dataclass(frozen=True)
class RabbitVhost:
    """A RabbitMQ virtual host this process created: its broker URL, its name, and how to reach the
    node with ``rabbitmqctl`` (``node``/``env`` for a private node, empty for the system one)."""

    url: str
    name: str
    node: str | None = None
    env: dict[str, str] | None = None


def rabbitmqctl(args: list[str], node: str | None = None, env: dict[str, str] | None = None,
                timeout: float = 60.0) -> str:
    """Run ``rabbitmqctl`` (quiet) against the system node, or ``node``; raise with its output on failure."""
    # A private node's cookie is under its own HOME: its CLI runs as us, not through the system
    # wrapper (which switches to the rabbitmq user and that user's cookie).
    program = str(RABBITMQ_SCRIPTS / "rabbitmqctl") if env else "rabbitmqctl"
    argv = [program, "-q", *(["-n", node] if node else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stdout} {done.stderr}".strip())
    return done.stdout


def create_vhost(base_url: str = RABBITMQ_URL, node: str | None = None, env: dict[str, str] | None = None) -> RabbitVhost:
    """A fresh virtual host on the node ``base_url`` names, open to that URL's user; nothing else on
    the node is visible from it, and deleting it deletes every queue and message in it."""
    parts = urlsplit(base_url)
    user = parts.username or "guest"
    name = f"pl-test-{uuid.uuid4().hex[:10]}"
    rabbitmqctl(["add_vhost", name], node, env)
    try:
        rabbitmqctl(["set_permissions", "-p", name, user, ".*", ".*", ".*"], node, env)
    except BaseException:
        rabbitmqctl(["delete_vhost", name], node, env)
        raise
    return RabbitVhost(urlunsplit((parts.scheme, parts.netloc, f"/{name}", "", "")), name, node, env)


def delete_vhost(vhost: RabbitVhost) -> None:
    """Delete a virtual host :func:`create_vhost` made (and every queue in it)."""
    if not vhost.name.startswith("pl-test-"):
        raise ValueError(f"refusing to delete a virtual host this kit did not create: {vhost.name!r}")
    rabbitmqctl(["delete_vhost", vhost.name], vhost.node, vhost.env)
