"""Fair turns between tenants that share an execute shard.

Tenant shards (``proofline/shards.py``) keep one tenant's burst off the other shards, but two
tenants whose names hash to the same shard share one FIFO queue: a single action of one waited
behind the other's whole burst (150 actions: 15.6 s, and all 150 finished first). Celery's queues
cannot be reordered, so the order is corrected at admission, where every delivery passes anyway:

Every tenant with work waiting is owed ``tenant_fair_share`` actions in flight (executing or
verifying) before any tenant takes more: an action of tenant T *yields its turn* when T already has
its share in flight (counting an older action of T's that is still ``published``: queued ahead, or
in another worker's preflight) and another tenant U has an action waiting (``published``) on the
same shard while U has fewer than its share in flight. Yielding releases the locks, records
``tenant_fair_wait`` on the action's chain (who waits, the share) and publishes the same signed
message again at the tail of its shard at once (a Celery retry without countdown); nothing was read
or claimed, so nothing is lost or duplicated (a re-sent copy meets the idempotency record like any
redelivery), and the reconciler still re-sends an action whose message went missing.

The rule is work-conserving: with no one below its share waiting, T takes every free slot, so a
lone tenant keeps its full throughput and two busy tenants never make each other yield. Yields
happen only while some waiting tenant is below its share, and stop as soon as it has it: the
waiting tenant's action starts once the messages ahead of it have yielded (one pass over the queue,
one delivery and one event each), not after the burst's work.

**A message yields at most once.** A delivery that is already a retry (it yielded before, or waited
out a busy target or a failed read) takes its turn. Yielding puts a message behind every action that
was waiting when it yielded, so one yield is all the order correction needs; a second one would only
spin. Without this bound, an action counted as waiting whose message is not in the queue (lost by the
broker or a killed worker, until the reconciler re-sends it) made every busier action on its shard
yield again and again at once: the queue turned over without progress and used up each message's
retries (seen in the chaos soak). A re-sent message (the reconciler's) may yield once more.
``tenant_fair_share = 0`` turns it off. Recovery actions (compensations) never yield. An action
waiting out a failed read (its retry due later: worker/read_waits.py) is not waiting in the queue
and is not yielded to.
"""

from __future__ import annotations

from typing import Any

from proofline.envelope import Envelope
from proofline.errors import TenantFairWait
from proofline.shards import shard_of

# The shard of w.tenant as proofline/shards.py computes it: the first 8 bytes of sha256, unsigned
# big-endian, modulo the shard count (bit(64)::bigint reads them signed: add 2**64 back).
_SHARD = """mod(CASE WHEN s.v < 0 THEN s.v::numeric + 18446744073709551616 ELSE s.v::numeric END, %s)"""
_BITS = """('x' || encode(substring(sha256(convert_to(w.tenant, 'UTF8')) from 1 for 8), 'hex'))::bit(64)::bigint"""

# Appended to the revalidation read. Parameters: see ``params``. No scan when the share is 0 or
# this tenant is below its share; otherwise it looks at waiting actions only (``actions_status_idx``).
# A tenant's actions in flight: executing or verifying, and (for the tenant asking) one more when an
# older action of its own is still published (queued ahead of this one, or in another worker's
# preflight, where the status does not show it yet).
_IN_FLIGHT = "status IN ('executing', 'verifying')"
WAITING_SQL = f"""(SELECT w.tenant FROM actions w CROSS JOIN LATERAL (SELECT {_BITS} AS v) s
   WHERE %s > 0 AND w.status = 'published' AND w.kind = 'action' AND w.tenant <> %s
     AND COALESCE((w.recovery_data->'read_failures'->>'due')::timestamptz <= clock_timestamp(), true)
     AND (SELECT count(*) FROM actions y WHERE y.tenant = %s AND y.{_IN_FLIGHT} AND y.action_id <> %s)
         + (SELECT count(*) FROM (SELECT 1 FROM actions o WHERE o.tenant = %s AND o.status = 'published'
              AND o.kind = 'action' AND o.published_at < (SELECT published_at FROM actions WHERE action_id = %s)
              LIMIT 1) older) >= %s
     AND (%s = 1 OR {_SHARD} = %s)
     AND (SELECT count(*) FROM actions x WHERE x.tenant = w.tenant AND x.{_IN_FLIGHT}) < %s
   ORDER BY w.published_at LIMIT 1) AS fair_waiting"""


def turn_share(envelope: Envelope, share: int, delivery: dict[str, Any]) -> int:
    """The share this delivery is held to: 0 (never yields) for a recovery action and for a delivery
    that is already a Celery retry of its message."""
    if envelope.recovers is not None or int(delivery.get("retries") or 0) > 0:
        return 0
    return share


def params(envelope: Envelope, share: int, shards: int) -> tuple[object, ...]:
    """The parameters of :data:`WAITING_SQL` for this envelope, in order (``share`` as
    :func:`turn_share` gives it: 0 skips the scan)."""
    tenant, aid = envelope.tenant, envelope.action_id
    return (share, tenant, tenant, aid, tenant, aid, share, shards, shards, shard_of(tenant, shards), share)


def yields(envelope: Envelope, share: int, waiting: str | None) -> TenantFairWait | None:
    """``TenantFairWait`` when this action gives its turn to ``waiting`` (another tenant, below its
    share, with an action waiting on the same shard); ``share`` as :func:`turn_share` gives it."""
    if share <= 0 or waiting is None:
        return None
    return TenantFairWait(f"tenant has its fair share ({share}) in flight while tenant {waiting[:100]!r} waits on "
                          f"the same shard with less: requeued at the tail", share=share, waiting_tenant=waiting[:100])
