"""Limits an envelope must respect before anything is called: the conditions it adds, its
deadline horizon and its authority budget (amount per action, amount per run, calls).

Checked in the execute task's revalidation (static checks, no I/O) and in the lease's
transaction (the run's running total, under a per-run transaction lock so that two actions of
one run cannot both spend the same budget). Every refusal closes the action as ``not_started``
with its reason code: nothing was sent.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from proofline.conditions import compile_expression, evaluate
from proofline.contracts import Contract
from proofline.envelope import Envelope
from proofline.errors import (
    AuthorityBudgetExceeded,
    ConditionError,
    ConditionInvalid,
    ConditionTooComplex,
    DeadlineTooFar,
)
from proofline.settings import Settings

# Actions of the run that count against its budget: everything except those proven to have moved
# nothing (closed or cancelled as not started / failed before any side effect).
RUN_SPENT_SQL = """
SELECT COALESCE(sum((recovery_data->>'amount_cents')::bigint), 0) AS spent, array_agg(action_id) AS counted,
       EXISTS (SELECT 1 FROM actions WHERE action_id = %(aid)s AND recovery_data ? 'amount_cents') AS admitted
  FROM actions
 WHERE run_id = %(run)s AND action_id <> %(aid)s AND recovery_data ? 'amount_cents'
   AND NOT (status IN ('closed', 'cancelled') AND outcome IN ('not_started', 'failed_before_side_effect'))
"""


def check_envelope_conditions(envelope: Envelope) -> int:
    """Every condition the envelope adds passes the static limits and compiles (cached)."""
    added = (*envelope.preconditions, *envelope.expected_postconditions)
    for expr in added:
        try:
            compile_expression(expr)
        except ConditionTooComplex:
            raise
        except ConditionError as exc:
            raise ConditionInvalid(exc.detail) from None
    return len(added)


def action_amount(contract: Contract, envelope: Envelope) -> int | None:
    """The amount of money the contract says this action moves (cents), or None when it moves none."""
    if not contract.amount_cents:
        return None
    doc = envelope.model_dump(mode="json")
    try:
        amount = evaluate(contract.amount_cents, {"envelope": doc, "args": doc["arguments"], "target": doc["target"]},
                          contract.compiled())
    except ConditionError as exc:
        raise AuthorityBudgetExceeded(f"the amount cannot be read: {exc.detail}", expr=contract.amount_cents) from None
    if isinstance(amount, bool) or not isinstance(amount, int) or amount < 0:
        raise AuthorityBudgetExceeded(f"the amount {amount!r:.100} is not a non-negative whole number of cents",
                                      expr=contract.amount_cents)
    return amount


def check_limits(envelope: Envelope, contract: Contract, settings: Settings, now: datetime,
                 published_at: datetime | None) -> dict[str, Any]:
    """The static limits; ``now`` is the database clock, ``published_at`` the action row's
    publication time (the database clock at publication) when there is one."""
    conditions = check_envelope_conditions(envelope)
    start = published_at or now
    horizon = (envelope.deadline - start).total_seconds()
    if horizon > settings.max_deadline_seconds:
        raise DeadlineTooFar(f"deadline {envelope.deadline.isoformat()} is {horizon:.0f}s after "
                             f"{'publication' if published_at else 'now'}; the limit is "
                             f"{settings.max_deadline_seconds:.0f}s", horizon_seconds=round(horizon))
    amount = action_amount(contract, envelope)
    budget = envelope.authority_budget.max_amount_cents
    if amount is not None and budget is not None and amount > budget:
        raise AuthorityBudgetExceeded(f"amount {amount} exceeds the authority budget of {budget} cents",
                                      amount_cents=amount, max_amount_cents=budget, scope="action")
    return {"envelope_conditions": conditions, "deadline_horizon_seconds": round(horizon),
            "amount_cents": amount, "max_amount_cents": budget, "max_calls": envelope.authority_budget.max_calls}


def check_run_budget_txn(cur: Any, envelope: Envelope, amount: int | None) -> dict[str, Any] | None:
    """Inside the lease's transaction: the run's spending so far plus this action stays within the
    budget. The caller records the returned ``amount_cents`` on the action in the same transaction
    (its guarded move to ``executing``), so the run's next action counts it.

    A transaction-scoped advisory lock on the run serialises this check between actions of one run
    (they may run at once on different targets); it is released with the transaction.
    """
    if amount is None:
        return None
    budget = envelope.authority_budget.max_amount_cents
    cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", ("proofline-run-budget:" + envelope.run_id,))
    cur.execute(RUN_SPENT_SQL, {"run": envelope.run_id, "aid": envelope.action_id})
    row = cur.fetchone()
    spent = int(row["spent"])
    if row["admitted"]:
        # Admitted on an earlier delivery (it may already have called): admission happens once.
        return {"amount_cents": amount, "run_spent_cents": spent, "max_amount_cents": budget, "admitted": "earlier"}
    if budget is not None and spent + amount > budget:
        raise AuthorityBudgetExceeded(
            f"run {envelope.run_id} has spent {spent} cents; {amount} more exceeds the budget of {budget}",
            amount_cents=amount, run_spent_cents=spent, max_amount_cents=budget, scope="run",
            counted=",".join(row["counted"] or []))
    return {"amount_cents": amount, "run_spent_cents": spent, "max_amount_cents": budget}
