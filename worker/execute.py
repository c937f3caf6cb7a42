"""The execute task's stages, in the seed's order, each recorded in the ledger with its evidence:

validate envelope → revalidate → acquire the lease → check/claim the idempotency record →
read the target and check preconditions → call the tool → classify → verify in place or enqueue
verification.

Commits on the happy path: one for lease + claim + pre-call evidence, one for the classified
result + lease release, with the verdict when the first verification read, made here through the
read identity, proves the post-condition (``worker/verification.py``). Everything else is a read
folded into those round trips.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Any

import psycopg

from ledger import refusals, store
from ledger.redact import POLICY, Redactor, current_redactor, for_envelope, for_message
from ledger.states import SETTLED_STATUSES, ActionStatus, Outcome
from proofline.bounded import safe_repr
from proofline.contracts import Contract
from proofline.envelope import Envelope
from proofline.errors import (
    ActionNotPublished,
    AuthorityBudgetExceeded,
    ConditionError,
    ConfigurationError,
    EnvelopeRefused,
    IdempotencyConflict,
    LeaseBusy,
    MalformedEnvelope,
    McpUnavailable,
    PlanChanged,
    ProoflineError,
    RevalidationFailed,
    StaleLease,
    TargetReadFailed,
    TenantFairWait,
    TenantQuotaExceeded,
)
from proofline.plan import check_plan
from proofline.telemetry import context as telemetry_context
from proofline.telemetry import metrics, tracing
from worker import capture, deliveries, fairness, faultpoints, quota, read_waits, sandbox_events
from worker.authorize import UNMANAGED, Decision, authorize
from worker.claim import claim_txn, claimed_events
from worker.classify import CallReport, Classification, classify
from worker.dispatch import Dispatch
from worker.lease import (
    Locks,
    SessionKeeper,
    action_lock_name,
    lease_arguments,
    release_lease_txn,
    target_lock_name,
    try_lock_and_read,
    unlock_sql,
    write_lease_txn,
)
from worker.lease import unlock as unlock_locks
from worker.limits import check_limits, check_run_budget_txn
from worker.plan import make_plan
from worker.preflight import (
    check_point_of_no_return,
    check_preconditions,
    live_negotiation,
    read_target,
    revalidated_contract,
)
from worker.record_call import FirstRead, result_evidence, write_result_txn
from worker.refused_claim import refused_after_claim_txn
from worker.results import result_limit
from worker.revalidation_reads import StoredAt, check_recovery_parent, recovery_tool_hashes
from worker.runtime import Runtime
from worker.servers import Server
from worker.summary import TaskSummary
from worker.tool_call import call_tool
from worker.validate import (
    claimed_fields,
    refusal_chain_id,
    revalidate_static,
    tool_switches,
    validate_envelope,
)
from worker.verification import decides_in_place, read_in_place

log = logging.getLogger(__name__)

# Read-only facts the revalidation needs, fetched in the same round trip that takes the locks. That
# statement opens the claim's transaction: it stays open (nothing written, no row locked) across the
# tool listing and the target read, and the claim commits it; a branch that writes ends it first.
REVALIDATION_SQL = """
SELECT clock_timestamp() AS now,
       (SELECT array_agg(identity) FROM revoked_identities WHERE identity = ANY(%s)) AS revoked,
       (SELECT json_agg(json_build_object('scope', scope, 'value', value, 'set_by', set_by, 'reason', reason))
          FROM kill_switches WHERE cleared_at IS NULL AND (scope = 'global'
            OR (scope = 'action_type' AND value = %s) OR (scope = 'tool' AND value = ANY(%s))
            OR (scope = 'tenant' AND value = %s) OR (scope = 'tool_tenant' AND value = ANY(%s)))) AS kills,
       (SELECT row_to_json(a) FROM (SELECT status, idempotency_key, cancel_requested_at, kind, parent_action_id,
                                             published_at
                                      FROM actions WHERE action_id = %s) a) AS action,
""" + quota.COUNT_SQL + ",\n" + fairness.WAITING_SQL

class RetryLater(Exception):
    """Ask Celery to deliver this message again after ``countdown`` seconds (same envelope, same key)."""

    def __init__(self, countdown: float, reason: str) -> None:
        super().__init__(countdown, reason)
        self.countdown, self.reason = countdown, reason


def record_refusal(rt: Runtime, message: Any, exc: ProoflineError, delivery: dict[str, Any]) -> None:
    """A refused message gets its own chain; it never touches a real action's state. Recording is
    total: the evidence is bounded and made writable whatever the message holds, and redacted by
    whatever the message itself declares secret, as far as it can be read."""
    try:
        red = redactor_for_message(rt, message)
    except Exception:  # noqa: BLE001 - an unreadable message still gets the policy's redaction
        red = POLICY
    refusals.record(rt.conn, refusal_chain_id(message), "envelope_refused", rt.settings.worker_id,
                    {**exc.as_evidence(), "claimed": claimed_fields(message), **delivery}, red)


def redactor_for_message(rt: Runtime, message: Any) -> Redactor:
    """The policy, the message's declarations, and its contract's sensitive fields when it names a
    known contract (any shape of input is accepted: this also redacts refusals)."""
    env = message.get("envelope") if isinstance(message, dict) else None
    fields: tuple[str, ...] = ()
    if isinstance(env, dict) and isinstance(env.get("action_type"), str):
        try:
            fields = rt.contract(env["action_type"]).sensitive_fields
        except ProoflineError:
            fields = ()
    return for_message(message, fields)


@sandbox_events.records_audit
def execute(rt: Runtime, message: Any, delivery: dict[str, Any], dispatch: Dispatch) -> dict[str, Any]:
    """Run one delivery of an execute message. Returns a small summary; raises RetryLater to requeue.
    Each stage is a span of the action's trace when tracing is on (proofline/telemetry/tracing.py)."""
    stages = tracing.Stages()
    try:
        return _execute(rt, message, delivery, dispatch, stages)
    finally:
        stages.close()


def _execute(rt: Runtime, message: Any, delivery: dict[str, Any], dispatch: Dispatch,
             stages: tracing.Stages) -> dict[str, Any]:
    settings = rt.settings
    actor = settings.worker_id
    # The claimed action id, unverified: only a test's fault point armed for one action reads it.
    faultpoints.hit("on_delivery", deliveries.message_action_id(message))
    stages.enter("proofline.preflight")
    try:
        try:
            stored = StoredAt(rt, message)
            envelope, contract = validate_envelope(message, settings, rt.contract, stored_at=stored)
            parent_link = check_recovery_parent(rt, envelope) if envelope.recovers is not None else None
        except (EnvelopeRefused, psycopg.Error, ConfigurationError):
            raise  # a worker without its keyring must not refuse good envelopes as malformed
        except Exception as exc:  # noqa: BLE001 - whatever input breaks validation is refused, never retried
            raise MalformedEnvelope(f"unreadable envelope: {safe_repr(exc, 500)}") from exc
    except EnvelopeRefused as exc:
        stages.note(**{"proofline.error_category": exc.code})
        record_refusal(rt, message, exc, delivery)
        log.warning("envelope refused", extra={"event": "envelope_refused", "reason_code": exc.code})
        return TaskSummary("refused", exc.code).as_dict()

    red = for_envelope(message["envelope"], contract.sensitive_fields)
    current_redactor.set(red)  # logs and Sentry events of this task are scrubbed with it too
    aid = envelope.action_id
    rt.mcp.action_id = aid  # calls from here on are this action's (worker/sandbox_events.py)
    rt.mcp.request_policy = contract.server_requests  # its servers' requests answered under its contract
    telemetry_context.bind(aid, run_id=envelope.run_id, tenant=envelope.tenant, action_type=envelope.action_type,
                           irreversible=envelope.irreversible, stage="execute")
    stages.describe(**tracing.about(envelope))
    events: list[tuple[str, dict[str, Any]]] = [
        ("validated", {"key_id": message.get("key_id"), "schema_version": envelope.schema_version,
                       "contract": contract.action_type, "contract_version": contract.version,
                       "contract_digest": contract.digest, "idempotency_key": envelope.idempotency_key,
                       "arguments_hash": envelope.arguments_hash, **delivery,
                       **({"parent_link": parent_link} if parent_link else {}),
                       **({"key_retired_after_storage": stored.evidence} if stored.evidence else {})}),
    ]
    locks = Locks(action_lock_name(aid), target_lock_name(envelope.tenant, envelope.target.type, envelope.target.id))
    conn = rt.conn
    fair_share = fairness.turn_share(envelope, settings.tenant_fair_share, delivery)
    t0 = time.monotonic()
    stages.enter("proofline.lease")
    try:
        facts = try_lock_and_read(conn, locks, REVALIDATION_SQL, (
            [envelope.requester, envelope.workload_identity], envelope.action_type, tool_switches(envelope),
            envelope.tenant, tool_switches(envelope, f"@{envelope.tenant}"), aid,
            settings.tenant_max_executing, envelope.tenant, aid,
            *fairness.params(envelope, fair_share, settings.tenant_shards)), hold=True)
    except LeaseBusy as exc:
        return _lease_busy(rt, envelope, exc, delivery)

    locked = True
    # From here the locks live on this session: keep it busy and never swap it, until they go.
    rt.holding_locks = True
    keeper = SessionKeeper(conn, settings.heartbeat_seconds, touch=rt.touch).start()
    try:
        existing = facts["action"]
        if existing is None:
            # Only a controller (or recovery, for a derived action) creates actions; the database
            # refuses this role the insert anyway. A signed message for an action nobody published
            # is recorded as a refusal on its own chain and touches nothing else.
            refused = ActionNotPublished(f"no action {aid} was published", action_id=aid)
            record_refusal(rt, message, refused, delivery)
            _unlock_now(rt, envelope)
            locked = False
            return TaskSummary("refused", refused.code).as_dict()
        if existing["idempotency_key"] != envelope.idempotency_key:
            return _conflict(rt, envelope, red, events, f"action {aid} was published with a different idempotency "
                             "key (different arguments, target or approval)")
        if existing["status"] in SETTLED_STATUSES:
            return _already_settled(rt, envelope, existing["status"], delivery)
        if existing["status"] == ActionStatus.pending:
            # A later step delivered before the runtime released it: it waits its turn.
            return _already_settled(rt, envelope, existing["status"], delivery, event="early_delivery_ignored")
        if existing["status"] == ActionStatus.proposed:
            # A proposal waits for an approver; an approval moves it back to published and sends it.
            return _already_settled(rt, envelope, existing["status"], delivery, event="proposal_waiting")
        if existing["cancel_requested_at"] and existing["status"] == ActionStatus.published:
            return _close_before_effect(rt, envelope, red, events, "cancelled_before_start",
                                        {"requested_at": str(existing["cancel_requested_at"])}, "cancelled",
                                        Outcome.not_started, dispatch, status=ActionStatus.cancelled)
        if existing["status"] == ActionStatus.verifying:
            with store.transaction(conn) as cur:
                store.append_event_txn(cur, aid, "redelivery_reenqueued_verification", actor, delivery)
            _unlock_now(rt, envelope)
            dispatch.verify(aid, envelope.tenant)
            return TaskSummary("verifying", "redelivered", aid).as_dict()
        waiting = quota.over(envelope, settings.tenant_max_executing, facts.get("tenant_executing")) or \
            fairness.yields(envelope, fair_share, facts.get("fair_waiting"))
        if waiting is not None:
            locked = False
            return _quota_wait(rt, envelope, waiting, delivery)

        server = rt.server(envelope.server.name)
        stages.enter("proofline.revalidation")
        try:
            static = revalidate_static(envelope, settings, facts["now"], facts["revoked"] or [], facts["kills"] or [])
            published_at = existing.get("published_at") if existing else None
            static["limits"] = check_limits(envelope, contract, settings, facts["now"],
                                            datetime.fromisoformat(published_at) if published_at else None)
            hashes, live = revalidated_contract(rt, server, envelope)
            live["negotiated"] = live_negotiation(rt, server)
            decision = authorize(rt, envelope, contract, facts["now"], static["limits"].get("amount_cents"),
                                 parent_link)
            static["authority"] = decision.evidence
            auditor = capture.require(rt, contract, static)  # fails closed before any call
            if decision.point_of_no_return:
                static["point_of_no_return"] = check_point_of_no_return(conn, envelope,
                                                                        legacy=decision.mode == UNMANAGED)
            recovery_tools = recovery_tool_hashes(rt, contract, server.name, hashes)
            if recovery_tools:
                # What recovery derives its envelopes from: it runs no tool servers of its own.
                live["recovery_tools"] = recovery_tools
        except RevalidationFailed as exc:
            return _not_started(rt, envelope, red, events, "revalidation_failed", exc.as_evidence(), exc.code, dispatch)
        except McpUnavailable as exc:
            return _transient_before(rt, envelope, red, events, exc, dispatch)
        events.append(("revalidated", {**static, **live}))

        stages.enter("proofline.precondition_read")
        try:
            before = read_target(rt, server, contract, envelope)
            target_read = rt.mcp.last_request  # the read's MCP request, for its evidence
        except (TargetReadFailed, McpUnavailable) as exc:
            return _transient_before(rt, envelope, red, events, exc, dispatch)
        except ConditionError as exc:
            # The read's arguments cannot be built from this envelope: the same on every delivery.
            return _not_started(rt, envelope, red, events, "preconditions_failed", exc.as_evidence(), exc.code,
                                dispatch)
        failures = check_preconditions(contract, envelope, before)
        # An approved plan is checked first (a changed target is a changed plan); a plan is only
        # proposed or simulated when its preconditions hold.
        if decision.approved_plan_hash or (not failures and decision.route != "execute"):
            try:
                routed = _plan_route(rt, envelope, contract, red, events, decision, before, server, dispatch)
            except (TargetReadFailed, McpUnavailable) as exc:
                return _transient_before(rt, envelope, red, events, exc, dispatch)
            except ConditionError as exc:  # the prepare tool's arguments cannot be built: never will be
                return _not_started(rt, envelope, red, events, "preconditions_failed", exc.as_evidence(), exc.code,
                                    dispatch)
            if routed is not None:
                return routed

        try:
            step, token = _lease_and_claim(rt, envelope, red, locks, events, failures, before,
                                           int(facts["fencing_token"]), target_read)
        except TenantQuotaExceeded as exc:  # the claim transaction rolled back: nothing was written
            locked = False
            return _quota_wait(rt, envelope, exc, delivery)
        except AuthorityBudgetExceeded as exc:  # the run's budget; the transaction rolled back
            return _not_started(rt, envelope, red, events, "revalidation_failed", exc.as_evidence(), exc.code,
                                dispatch)
        except LeaseBusy as exc:  # this session lost its locks before the claim: nothing was written
            locked = False
            return _lease_busy(rt, envelope, exc, delivery)
        if step != "call":
            locked = False
        if step == "not_started":
            closed_hook(rt, envelope, ActionStatus.closed, Outcome.not_started, dispatch)
            return TaskSummary("closed", failures[0]["reason"], aid, Outcome.not_started.value).as_dict()
        if step == "budget_exhausted":
            closed_hook(rt, envelope, ActionStatus.closed, Outcome.failed_before_side_effect, dispatch)
            return TaskSummary("closed", AuthorityBudgetExceeded.code, aid,
                               Outcome.failed_before_side_effect.value).as_dict()
        if step == "reconcile":
            dispatch.verify(aid, envelope.tenant)
        if step != "call":
            return TaskSummary(step, None, aid).as_dict()

        stages.enter("proofline.tool_call")
        plan_meta = next(({"proofline/plan_hash": ev["plan_hash"], **({"proofline/plan_id": ev["plan_id"]}
                                                                   if ev.get("plan_id") else {})}
                          for name, ev in events if name == "plan_confirmed"), None)
        report = call_tool(rt, server, envelope, contract, token, facts["now"], t0, plan_meta)
        verdict = classify(report, contract, result_limit(settings, server, contract))
        for _ in report.progress:
            stages.event("progress")
        stages.note(**{"proofline.outcome": verdict.outcome.value,
                       "proofline.error_category": None if report.error is None else verdict.reason_code})
        metrics.TOOL_CALL_SECONDS.labels(envelope.action_type, verdict.outcome.value).observe(report.elapsed_seconds)
        first = None
        if decides_in_place(settings, verdict, contract):
            stages.enter("proofline.verification", **{"proofline.tool": contract.verification_read.tool})
            first = read_in_place(rt, envelope, contract, before, verdict, red, token)
            stages.note(**{"proofline.verification_finding": first.obs.finding.value})
        stages.enter("proofline.record_result")
        locked = False  # the result transaction releases both locks as its last statement
        sealed = capture.seal_call(rt, auditor, envelope, contract, before, verdict.values,
                                   first.obs.after if first is not None else None)
        return _record_result(rt, envelope, red, verdict, report, token, locks, dispatch, first,
                              existing.get("published_at"), (contract, sealed))
    except BaseException:
        if locked and not conn.closed and not conn.broken:
            try:
                store.end_held_read(conn)
                unlock_locks(conn, locks)
            except psycopg.Error:
                rt.reset_connection()
        raise
    finally:
        keeper.stop()
        if not conn.closed and not conn.broken:
            # The lock-and-read transaction is finished by the claim, or by any branch's own write;
            # a branch that wrote nothing leaves it to end here.
            store.end_held_read(conn)
        rt.holding_locks = False


def _plan_route(rt: Runtime, envelope: Envelope, contract: Contract, red: Redactor, events: list,
                decision: Decision, before: dict[str, Any], server: Server, dispatch: Dispatch) -> dict[str, Any] | None:
    """Prepare the plan: record it and stop (simulate), record it and wait for an approver
    (propose), or refuse the commit when it is not the plan the approvals name (``plan_changed``).
    None: the approved plan is the one in front of us, go on to the call."""
    plan = make_plan(rt, server, contract, envelope)
    evidence = {**plan.as_evidence(), **decision.evidence}
    if decision.route == "simulate":
        return _not_started(rt, envelope, red, events, "simulated", evidence, "simulated", dispatch)
    if decision.route == "propose":
        with store.transaction(rt.conn) as cur:
            store.transition_txn(cur, envelope.action_id, [ActionStatus.published], ActionStatus.proposed,
                                 reason_code="awaiting_approval", events=[*events, ("proposed", evidence)],
                                 actor=rt.settings.worker_id, redactor=red)
        _unlock_now(rt, envelope)
        return TaskSummary("proposed", "awaiting_approval", envelope.action_id).as_dict()
    try:
        # The approval names the plan by hash; its target version is the one the approver reviewed.
        check_plan(str(decision.approved_plan_hash),
                   envelope.target.expected_version if plan.target_version is not None else None, plan)
    except PlanChanged as exc:
        return _not_started(rt, envelope, red, events, "revalidation_failed", {**exc.as_evidence(), **evidence},
                            exc.code, dispatch)
    events.append(("plan_confirmed", {"plan_hash": plan.hash, "plan_id": plan.plan_id}))
    return None


def _lease_and_claim(rt: Runtime, envelope: Envelope, red: Redactor, locks: Locks, events: list,
                     failures: list[dict[str, str]], before: dict[str, Any], token: int,
                     read: dict[str, Any] | None = None) -> tuple[str, int]:
    """The claim stage under ``token`` (drawn when the locks were taken): the run's budget, the
    lease, the claim and the pre-call evidence, in one transaction. Returns the next step and the
    token. A first delivery with nothing else to check is one statement (``proofline_claim``)."""
    settings, actor = rt.settings, rt.settings.worker_id
    amount = next((ev["limits"]["amount_cents"] for name, ev in events if name == "revalidated"), None)
    lease_event = ("lease_acquired", {"fencing_token": token, "worker_id": actor, "target": locks.target,
                                      "ttl_seconds": settings.lease_ttl_seconds})
    if not failures and amount is None and not quota.applies(envelope, settings.tenant_max_executing):
        claimed = store.claim_and_start(
            rt.conn, key=envelope.idempotency_key, action_id=envelope.action_id, tenant=envelope.tenant,
            argument_hash=envelope.arguments_hash, contract_hash=envelope.tool.contract_hash,
            replay_window_seconds=settings.replay_window_seconds,
            lease=lease_arguments(envelope.action_id, locks.target, actor, settings.lease_ttl_seconds, locks, token),
            recovery_data={"before": before}, redactor=red, actor=actor,
            events=[*events, lease_event, *claimed_events(envelope, before, token, read)])
        if claimed:
            return "call", token
        # The key has a record (a redelivery): nothing was written; dispatch on it below.
    with store.transaction(rt.conn) as cur:
        quota.check_txn(cur, envelope, settings.tenant_max_executing)
        budget = check_run_budget_txn(cur, envelope, amount)
        if budget is not None:
            events.append(("authority_budget_checked", budget))
        write_lease_txn(cur, envelope.action_id, locks.target, actor, settings.lease_ttl_seconds, locks, token)
        events.append(lease_event)
        # The admitted amount is recorded by the guarded move to executing (no separate update).
        admitted = {"amount_cents": budget["amount_cents"]} if budget and "admitted" not in budget else {}
        step = claim_txn(cur, envelope, red, events, failures, before, token, actor, settings.replay_window_seconds,
                          admitted, read)
        if step != "call":
            release_lease_txn(cur, envelope.action_id, token)
            cur.execute(*unlock_sql(locks))
    return step, token


# --- the branches ------------------------------------------------------------------------------


def _lease_busy(rt: Runtime, envelope: Envelope, exc: LeaseBusy, delivery: dict[str, Any]) -> dict[str, Any]:
    aid = envelope.action_id
    with store.transaction(rt.conn) as cur:
        if exc.context.get("which") == "action":
            # A live worker is advancing this very action: this delivery is a duplicate. Ack, do nothing.
            store.append_event_txn(cur, aid, "redelivery_ignored", rt.settings.worker_id,
                                   {**exc.as_evidence(), **delivery, "idempotency_key": envelope.idempotency_key,
                                    "arguments_hash": envelope.arguments_hash})
            return TaskSummary("ignored", exc.code, aid).as_dict()
        event = "lock_session_lost" if exc.context.get("which") == "lost" else "target_busy"
        store.append_event_txn(cur, aid, event, rt.settings.worker_id, {**exc.as_evidence(), **delivery})
    raise RetryLater(envelope.retry_policy.backoff_seconds, exc.code)


def _quota_wait(rt: Runtime, envelope: Envelope, exc: TenantQuotaExceeded, delivery: dict[str, Any]) -> dict[str, Any]:
    """Over the tenant's quota, or yielding its turn (worker/fairness.py): release both locks first
    (another worker may take the target), record the wait, and deliver the same envelope again after
    the short busy-target backoff (a turn yielded: at once, at the tail of its shard)."""
    _unlock_now(rt, envelope)
    with store.transaction(rt.conn) as cur:
        store.append_event_txn(cur, envelope.action_id, exc.code, rt.settings.worker_id,
                               {**exc.as_evidence(), **delivery})
    raise RetryLater(0 if isinstance(exc, TenantFairWait) else envelope.retry_policy.backoff_seconds, exc.code)


def _conflict(rt: Runtime, envelope: Envelope, red: Redactor, events: list, detail: str) -> dict[str, Any]:
    exc = IdempotencyConflict(detail, idempotency_key=envelope.idempotency_key,
                              arguments_hash=envelope.arguments_hash)
    with store.transaction(rt.conn) as cur:
        store.append_events_txn(cur, envelope.action_id, rt.settings.worker_id,
                                [*events, ("idempotency_conflict", exc.as_evidence())], red)
    _unlock_now(rt, envelope)
    return TaskSummary("refused", exc.code, envelope.action_id).as_dict()


def _already_settled(rt: Runtime, envelope: Envelope, status: str, delivery: dict[str, Any],
                     event: str = "duplicate_suppressed") -> dict[str, Any]:
    with store.transaction(rt.conn) as cur:
        store.append_event_txn(cur, envelope.action_id, event, rt.settings.worker_id,
                               {"status": status, "reason": "action already settled", **delivery})
    _unlock_now(rt, envelope)
    return TaskSummary("duplicate_suppressed", status, envelope.action_id).as_dict()


def _unlock_now(rt: Runtime, envelope: Envelope) -> None:
    unlock_locks(rt.conn, Locks(action_lock_name(envelope.action_id),
                                target_lock_name(envelope.tenant, envelope.target.type, envelope.target.id)))


def _close_before_effect(rt: Runtime, envelope: Envelope, red: Redactor, events: list, event: str, evidence: dict[str, Any],
                         reason: str, outcome: Outcome, dispatch: Dispatch,
                         status: ActionStatus = ActionStatus.closed) -> dict[str, Any]:
    with store.transaction(rt.conn) as cur:
        cur.execute("SELECT status FROM actions WHERE action_id = %s", (envelope.action_id,))
        row = cur.fetchone()
        claimed = row is not None and row["status"] == ActionStatus.executing
        if claimed:  # an earlier delivery claimed it: worker/refused_claim.py
            status, outcome, reason = refused_after_claim_txn(rt, cur, envelope, red, [*events, (event, evidence)],
                                                              reason)
        else:
            store.transition_txn(cur, envelope.action_id, [ActionStatus.published], status,
                                 outcome=outcome, reason_code=reason, events=[*events, (event, evidence)],
                                 actor=rt.settings.worker_id, redactor=red)
    if claimed and status == ActionStatus.verifying:  # committed, locks released with it
        dispatch.verify(envelope.action_id, envelope.tenant)
        return TaskSummary(status.value, reason, envelope.action_id, outcome.value).as_dict()
    if not claimed:
        _unlock_now(rt, envelope)
    closed_hook(rt, envelope, status, outcome, dispatch)
    return TaskSummary(status.value, reason, envelope.action_id, outcome.value).as_dict()


def _not_started(rt, envelope, red, events, event, evidence, reason, dispatch) -> dict[str, Any]:
    return _close_before_effect(rt, envelope, red, events, event, evidence, reason, Outcome.not_started, dispatch)


def closed_hook(rt: Runtime, envelope: Envelope, status: ActionStatus, outcome: Outcome | None,
                dispatch: Dispatch) -> None:
    """What a settled action means for others: its run, or the action it compensates (the
    dispatcher's settle hook, wired in by the Celery app module)."""
    dispatch.settled(rt.conn, rt.settings.worker_id, envelope.action_id, envelope=envelope, status=status,
                     outcome=outcome)


def _transient_before(rt: Runtime, envelope: Envelope, red: Redactor, events: list, exc: ProoflineError,
                      dispatch: Dispatch) -> dict[str, Any]:
    """Nothing was sent: retry the same envelope later while the deadline allows, backing off
    (worker/read_waits.py); then close it before any side effect, with every cause counted."""
    remaining = envelope.deadline.timestamp() - time.time()
    wait = read_waits.wait_or_close(rt.conn, envelope, red, events, exc, rt.settings.worker_id,
                                    rt.settings.precheck_backoff_cap_seconds, remaining)
    if wait.decision == "close":
        return _close_before_effect(rt, envelope, red, events, "precheck_unavailable", wait.evidence, exc.code,
                                    Outcome.failed_before_side_effect, dispatch)
    _unlock_now(rt, envelope)
    if wait.decision == "yield":  # another delivery's retry of this action is due: one chain of retries
        return TaskSummary("ignored", exc.code, envelope.action_id).as_dict()
    raise RetryLater(wait.seconds, exc.code)


def _record_result(rt: Runtime, envelope: Envelope, red: Redactor, verdict: Classification, report: CallReport,
                   token: int, locks: Locks, dispatch, first: FirstRead | None = None,
                   published_at: str | None = None, captured: tuple[Contract, list] | None = None) -> dict[str, Any]:
    aid = envelope.action_id
    evidence = result_evidence(envelope, verdict, report)
    audit = sandbox_events.pending(rt, aid)  # taken once: a retried write records the same findings
    try:
        try:
            retry, verified = write_result_txn(rt, envelope, red, verdict, evidence, token, locks,
                                               report.sandbox_violation, audit, first)
        except psycopg.OperationalError:
            # The session died while we called (and its locks with it). Write again on a new
            # session: the fencing token still decides whether this worker may record the result.
            rt.reset_connection()
            retry, verified = write_result_txn(rt, envelope, red, verdict, evidence, token, locks,
                                               report.sandbox_violation, audit, first)
    except StaleLease as exc:
        # Another holder took over: keep what we saw as evidence, change nothing else.
        with store.transaction(rt.conn) as cur:
            store.append_event_txn(cur, aid, "stale_write_refused", rt.settings.worker_id,
                                   {**exc.as_evidence(), "observed": evidence,
                                    **({"first_read": first.evidence} if first is not None else {})}, red)
            store.append_events_txn(cur, aid, rt.settings.worker_id,
                                    sandbox_events.write_pending_txn(cur, rt, aid, audit), red)
        unlock_locks(rt.conn, locks)
        return TaskSummary("refused", exc.code, aid).as_dict()
    if captured is not None:  # after the result's commit, in a transaction of its own (worker/capture.py)
        capture.write(rt, aid, *captured)
    if verdict.outcome == Outcome.failed_before_side_effect:
        tracing.mark("proofline.retry_decision", **{"proofline.error_category": verdict.reason_code,
                                                     "proofline.recovery_kind": "retry" if retry else None})
        if retry:
            raise RetryLater(envelope.retry_policy.backoff_seconds, verdict.reason_code)
        closed_hook(rt, envelope, ActionStatus.closed, verdict.outcome, dispatch)
        return TaskSummary("closed", verdict.reason_code, aid, verdict.outcome.value).as_dict()
    faultpoints.hit("after_ledger", aid)
    if verified:
        assert first is not None
        metrics.VERIFICATION_SECONDS.labels(envelope.action_type, first.obs.finding.value).observe(first.seconds)
        if published_at:
            metrics.PUBLISH_TO_VERIFIED_SECONDS.labels(envelope.action_type).observe(
                max(time.time() - datetime.fromisoformat(published_at).timestamp(), 0.0))
        log.info("verified", extra={"action_id": aid, "event": "verification_finished",
                                    "finding": first.obs.finding.value, "in_place": True})
        closed_hook(rt, envelope, ActionStatus.closed, Outcome.completed_verified, dispatch)
        return TaskSummary("closed", "verified", aid, Outcome.completed_verified.value).as_dict()
    dispatch.verify(aid, envelope.tenant)
    return TaskSummary("verifying", verdict.reason_code, aid, verdict.outcome.value).as_dict()
