"""A check before the call refused an action that an earlier delivery had already claimed.

Split out of ``worker/execute.py`` (its ``_close_before_effect`` calls it when the action is
``executing``, not ``published``).
"""

from __future__ import annotations

from typing import Any

from ledger import store
from ledger.redact import Redactor
from ledger.states import ActionStatus, IdempotencyStatus, Outcome
from proofline.envelope import Envelope
from worker.lease import (
    Locks,
    action_lock_name,
    release_lease_txn,
    target_lock_name,
    unlock_sql,
    write_lease_txn,
)
from worker.runtime import Runtime


def refused_after_claim_txn(rt: Runtime, cur: store.Cursor, envelope: Envelope, red: Redactor, events: list[Any],
                             reason: str) -> tuple[ActionStatus, Outcome, str]:
    """A check before the call refused an action an earlier delivery had claimed: it is
    ``executing`` under a holder that is gone (a kill switch engaged, a deadline passed, since).
    That holder's call may have been made, so it is never closed as not started (which the ledger
    refuses from ``executing``: the delivery retried for ever and the action stayed open). This
    delivery takes the lease under a new token; a record still in progress (or unknown) is marked
    unknown and verification decides, as for any redelivery of a claimed action; a record proven
    to have made no effect (failed), or none, closes it as failed before any side effect. Releases
    lease and locks as its last statements; returns the status, outcome and reason it recorded."""
    aid, actor, key = envelope.action_id, rt.settings.worker_id, envelope.idempotency_key
    locks = Locks(action_lock_name(aid), target_lock_name(envelope.tenant, envelope.target.type, envelope.target.id))
    token = write_lease_txn(cur, aid, locks.target, actor, rt.settings.lease_ttl_seconds, locks)
    record = store.get_idempotency_txn(cur, key)
    unsettled = record is not None and record.status != IdempotencyStatus.failed
    if record is not None and record.status in (IdempotencyStatus.in_progress, IdempotencyStatus.unknown):
        store.update_idempotency_txn(cur, key, fencing_token=record.fencing_token,
                                     allowed=[IdempotencyStatus.in_progress, IdempotencyStatus.unknown],
                                     status=IdempotencyStatus.unknown, new_token=token)
    if record is not None and unsettled:
        events = [*events, ("reconcile_required", {"key": key, "record_status": record.status.value,
                                                   "previous_fencing_token": record.fencing_token,
                                                   "fencing_token": token, "refused_by": reason})]
        status, outcome, code = ActionStatus.verifying, Outcome.unknown_outcome, "reconcile_required"
    else:
        status, outcome, code = ActionStatus.closed, Outcome.failed_before_side_effect, reason
    store.transition_txn(cur, aid, [ActionStatus.executing], status, outcome=outcome, reason_code=code,
                         events=events, actor=actor, redactor=red)
    release_lease_txn(cur, aid, token)
    cur.execute(*unlock_sql(locks))
    return status, outcome, code
