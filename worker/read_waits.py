"""A precondition read (or prepare) that fails before any side effect, waited out cheaply.

Nothing was sent, so the same envelope is delivered again while its deadline allows. Three rules
keep a read that keeps failing from costing more than it tells:

- **Backoff.** The wait doubles with each retry of the delivery (the envelope's
  ``retry_policy.backoff_seconds`` first), is capped at ``precheck_backoff_cap_seconds`` and carries
  "equal jitter" (a uniform draw over the upper half), so actions that failed together do not
  come back together.
- **One event per distinct cause.** A cause is the reason code and the failure's detail with its
  numbers blanked (a timeout after 5.01 s and one after 5.03 s are one cause). Its first failure is
  recorded (``precheck_unavailable``, with the cause's digest); later ones only count, in the
  action's ``recovery_data.read_failures`` (bookkeeping like the reconciler's redrive count: the
  role guard does not take it for a transition). The closing record carries every cause's count.
- **One chain of retries.** The same bookkeeping says which delivery's retry is due and when. The
  reconciler does not re-send an action whose retry is due (or only just overdue), and a copy
  that was re-sent anyway (its first delivery sat in a busy queue) and fails too ends there,
  counted, instead of starting a second chain of retries. A retry that is lost is re-sent by the
  reconciler once it is overdue.
- **The documented end.** When the next wait would not leave time for the read before the
  deadline, the worker closes the action itself: ``failed_before_side_effect`` with the read's
  reason code (``target_read_failed``, ``prepare_failed``, ``mcp_unavailable``).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ledger import store
from ledger.redact import Redactor
from proofline.envelope import Envelope
from proofline.errors import ProoflineError
from worker.broker import whole_seconds

#: The smallest first wait, whatever the envelope says (a zero backoff would never grow).
MIN_BASE_SECONDS = 0.1
_NUMBERS = re.compile(r"\d+(?:\.\d+)?")

# recovery_data.read_failures = {"due": when the next attempt is due, "task_id", "attempt": the
# delivery (and its attempt) whose retry that is, "causes": {cause: {reason_code, count, first_at,
# last_at}}}. A delivery that finds another delivery's retry still due counts its failure and
# leaves the due retry as it was (``yielded``).
COUNT_SQL = """
WITH f AS (SELECT COALESCE(recovery_data->'read_failures'->'causes'->%(cause)s, '{}'::jsonb) AS c,
                  COALESCE(recovery_data->'read_failures'->>'task_id' IS DISTINCT FROM %(task_id)s::text
                           AND (recovery_data->'read_failures'->>'due')::timestamptz > clock_timestamp(),
                           false) AS yielded
             FROM actions WHERE action_id = %(id)s)
UPDATE actions SET recovery_data = jsonb_set(recovery_data, '{read_failures}',
  (CASE WHEN f.yielded THEN recovery_data->'read_failures' ELSE COALESCE(recovery_data->'read_failures', '{}'::jsonb)
        || jsonb_build_object('due', to_jsonb(clock_timestamp() + make_interval(secs => %(wait)s)),
                              'task_id', %(task_id)s::text, 'attempt', %(attempt)s::int) END)
  || jsonb_build_object('causes', COALESCE(recovery_data->'read_failures'->'causes', '{}'::jsonb) || jsonb_build_object(
        %(cause)s::text, jsonb_build_object(
            'reason_code', %(code)s::text,
            'count', COALESCE((f.c->>'count')::int, 0) + 1,
            'first_at', COALESCE(f.c->'first_at', to_jsonb(clock_timestamp())),
            'last_at', to_jsonb(clock_timestamp())))))
FROM f WHERE action_id = %(id)s AND status = 'published'
RETURNING (recovery_data->'read_failures'->'causes'->%(cause)s->>'count')::int AS count,
          recovery_data->'read_failures'->'causes' AS causes, f.yielded
"""


@dataclass(frozen=True)
class Wait:
    """What to do after a failed read: ``retry`` after ``seconds``, ``close`` the action now, or
    ``yield`` (another delivery's retry of this action is due: this delivery ends here)."""

    decision: str
    seconds: float
    evidence: dict[str, Any]


def cause_of(exc: ProoflineError) -> str:
    """A short digest naming what failed, stable across retries of the same failure."""
    detail = _NUMBERS.sub("#", str(exc.detail)[:300])
    return hashlib.sha256(json.dumps([exc.code, detail]).encode()).hexdigest()[:16]


def backoff(base: float, retries: int, cap: float, draw: Callable[[], float] = random.random) -> float:
    """The wait before attempt ``retries + 1``: ``base * 2**retries`` capped at ``cap``, the upper
    half of it drawn at random."""
    ceiling = min(cap, max(base, MIN_BASE_SECONDS) * 2.0 ** min(retries, 32))
    return ceiling / 2 + draw() * ceiling / 2


def summary(failures: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every cause's count, oldest first, as the closing record shows them."""
    rows = [{"cause": cause, **value} for cause, value in (failures or {}).items() if isinstance(value, dict)]
    return sorted(rows, key=lambda r: str(r.get("first_at", "")))


def count_txn(cur: Any, action_id: str, exc: ProoflineError, wait: float,
              delivery: dict[str, Any]) -> tuple[int, list[dict[str, Any]], bool]:
    """Count one failure of ``exc``'s cause on the action and, unless another delivery's retry is
    still due (returned ``True``: it stays the one due), make this delivery's retry the one due
    after ``wait`` seconds (the reconciler does not re-send an action whose retry is due:
    recovery/reconciler.py). Returns this cause's count, all causes, and whether it yielded."""
    cur.execute(COUNT_SQL, {"cause": cause_of(exc), "code": exc.code, "id": action_id, "wait": wait,
                            "task_id": delivery.get("task_id"), "attempt": int(delivery.get("retries") or 0) + 1})
    row = cur.fetchone()
    if row is None:  # no longer published: nothing to wait for, the caller's guarded close decides
        return 0, [], False
    return int(row["count"]), summary(row["causes"]), bool(row["yielded"])


def wait_or_close(conn: Any, envelope: Envelope, red: Redactor, events: list[tuple[str, dict[str, Any]]],
                  exc: ProoflineError, actor: str, cap: float, remaining: float) -> Wait:
    """Count this failure and decide: another attempt when one fits before the deadline (recorded
    when its cause is new), none when another delivery's retry is due, else close (the evidence
    the closing record carries)."""
    delivery = next((ev for name, ev in events if name == "validated"), {})
    retries = int(delivery.get("retries") or 0)
    # Countdowns travel in whole seconds (worker/broker.py): the bookkeeping says what really happens.
    wait = float(whole_seconds(backoff(envelope.retry_policy.backoff_seconds, retries, cap)))
    evidence = {**exc.as_evidence(), "cause": cause_of(exc), "attempt": retries + 1}
    with store.transaction(conn) as cur:
        count, causes, yielded = count_txn(cur, envelope.action_id, exc, wait, delivery)
        evidence["count"] = count
        if remaining <= wait + envelope.timeout_seconds:
            return Wait("close", 0.0, {**evidence, "read_failures": causes})
        if yielded:
            return Wait("yield", 0.0, evidence)
        if count == 1:
            store.append_events_txn(cur, envelope.action_id, actor,
                                    [*events, ("precheck_unavailable", {**evidence, "retry_in_seconds": wait})], red)
    return Wait("retry", wait, evidence)
