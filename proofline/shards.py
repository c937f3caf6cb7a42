"""Which execute queue a tenant's actions travel on.

The execute queue is sharded by tenant so that one tenant's burst fills its own shard and cannot
starve the others: a worker consumes every shard, and the Redis transport rotates the order in
which it asks for them (see ``worker_queues``). The shard is a stable hash (sha256, not Python's
per-process salted ``hash``) so every publisher and every process agrees on it.
"""

from __future__ import annotations

import hashlib

#: Shard 0 keeps the historical name, so a message put on ``actions`` by hand is still consumed.
BASE_QUEUE = "actions"
#: Verification is sharded the same way: a burst's verifications must not delay another tenant's.
VERIFY_QUEUE = "verify"
SHARDED = (BASE_QUEUE, VERIFY_QUEUE)
#: kombu's Redis transport keeps priorities 3, 6 and 9 of a queue in lists of their own.
REDIS_PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")


def shard_of(tenant: str, shards: int) -> int:
    if shards <= 1:
        return 0
    digest = hashlib.sha256(tenant.encode("utf-8", errors="replace")).digest()
    return int.from_bytes(digest[:8], "big") % shards


def queue_name(shard: int, base: str = BASE_QUEUE) -> str:
    return base if shard == 0 else f"{base}.{shard}"


def queue_for_tenant(tenant: object, shards: int, base: str = BASE_QUEUE) -> str:
    """The ``base`` queue shard of ``tenant``. Anything that is not a tenant string (a hostile or
    broken message) goes to shard 0; the worker refuses it there with its reason."""
    if not isinstance(tenant, str) or not tenant:
        return base
    return queue_name(shard_of(tenant, shards), base)


def sharded_queues(base: str, shards: int) -> list[str]:
    """Every shard of a sharded queue (``actions`` or ``verify``), in order."""
    return [queue_name(i, base) for i in range(max(1, shards))]


def execute_queues(shards: int) -> list[str]:
    """Every execute shard, in order. Workers consume all of them.

    Fairness comes from kombu's Redis transport (kombu 5.7, ``kombu/transport/redis.py``):
    ``Channel._brpop_start`` issues one ``BRPOP`` over the queues in the order of its
    ``_queue_cycle`` (a ``round_robin_cycle``), Redis pops from the first non-empty key, and
    ``_brpop_read`` then calls ``self._queue_cycle.rotate(dest)``, moving the queue that just
    delivered to the end of the order. So among non-empty shards each gets its turn, and with
    ``worker_prefetch_multiplier = 1`` a worker never holds a backlog of one shard in memory.
    """
    return [queue_name(i) for i in range(max(1, shards))]
