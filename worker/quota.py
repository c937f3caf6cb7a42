"""Per-tenant concurrency quota, checked when an action is about to start executing.

Two checks, both cheap: a count read in the revalidation round trip (an action over quota waits
before any tool read), and the authoritative one inside the claim transaction, under a
transaction-scoped advisory lock per tenant, so two workers starting actions of one tenant at the
same moment cannot both see room for one more (the lock is held only until that transaction's
move to ``executing`` commits).
"""

from __future__ import annotations

from typing import Any

from proofline.envelope import Envelope
from proofline.errors import TenantQuotaExceeded

# Appended to the revalidation read; no scan at all when the quota is off (``0 > 0`` folds to false).
# Parameters: limit, tenant, action id.
COUNT_SQL = """(SELECT count(*) FROM actions WHERE %s > 0 AND tenant = %s AND status = 'executing'
                   AND action_id <> %s) AS tenant_executing"""


def applies(envelope: Envelope, limit: int) -> bool:
    # Recovery actions (compensations) undo effects already made: they are never held back by the
    # tenant's own forward work, though they count while they execute.
    return limit > 0 and envelope.recovers is None


def over(envelope: Envelope, limit: int, executing: int | None) -> TenantQuotaExceeded | None:
    if not applies(envelope, limit) or executing is None or executing < limit:
        return None
    return TenantQuotaExceeded(f"tenant has {executing} actions executing (limit {limit})",
                               executing=executing, limit=limit)


def check_txn(cur: Any, envelope: Envelope, limit: int) -> None:
    """Inside the claim transaction: raise TenantQuotaExceeded (the transaction rolls back) when the
    tenant is at its limit. The advisory lock serialises concurrent starts of one tenant."""
    if not applies(envelope, limit):
        return
    cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"proofline:tenant-quota:{envelope.tenant}",))
    cur.execute("SELECT count(*) AS n FROM actions WHERE tenant = %s AND status = 'executing' AND action_id <> %s",
                (envelope.tenant, envelope.action_id))
    row = cur.fetchone()
    executing = int(row["n"] if isinstance(row, dict) else row[0])
    exc = over(envelope, limit, executing)
    if exc is not None:
        raise exc
