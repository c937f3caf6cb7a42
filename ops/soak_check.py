"""The soak's history checker: after the faults heal and the system goes quiet, every invariant is
checked over the whole ledger and the system of record's own effects log.

Invariants (each failure names the offending action ids or idempotency keys):

``nothing_lost``
    every submitted action is in the ledger; every action (compensations included) is ``closed``
    or ``cancelled``, or ``escalated`` with a ledger event that explains why.
``no_duplicates``
    at most one effect per idempotency key in the system of record, and exactly one where the
    ledger says the effect happened (outcome ``completed_verified``, or ``compensated`` for the
    original action's key).
``nothing_unexplained``
    every effect carrying a key maps to an action's key in the ledger; effects without a key are
    only the system's own bookkeeping; an action the ledger closed as not started (or failed
    before any side effect) has no effect.
``verified_not_guessed``
    an outcome that was unknown at some point was settled by a verification read afterwards.
``chains_intact`` / ``no_advisory_locks`` / ``no_open_leases``
    every hash chain verifies; no advisory lock is held on the stack's database; no lease row is
    left unreleased.
``configured``
    no event reports a configuration error (a server the contracts use and the soak's servers
    file lacks): the soak tests faults, not its own setup.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proofline.ledger_check import check_chains
from proofline_kit.sor import store as sor

OPEN_STATUSES = ("published", "executing", "verifying", "recovery", "pending")
#: Ledger events that explain why an action waits in the manual queue.
EXPLAINING = frozenset({"escalated", "compensation_failed", "verification_finished", "recovery_decided",
                        "recovery_action_underivable", "contained", "escalated_state"})
#: Effects the system of record writes on its own, without a caller's key (``proofline_kit/sor``):
#: a restart operation finishing (``core.settle``) and a simulated concurrent change (``seed.bump_version``).
BOOKKEEPING_TOOLS = frozenset({"operation_completed", "external_change"})
#: Outcomes that say the effect happened exactly once.
HAPPENED = frozenset({"completed_verified", "compensated"})
#: Outcomes of a closed action that say no effect happened.
NO_EFFECT = frozenset({"not_started", "failed_before_side_effect"})
INVARIANTS = ("nothing_lost", "no_duplicates", "nothing_unexplained", "verified_not_guessed", "chains_intact",
              "no_advisory_locks", "no_open_leases", "configured")


@dataclass
class Violation:
    invariant: str
    subject: str
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"invariant": self.invariant, "subject": self.subject, "detail": self.detail}


@dataclass
class CheckResult:
    violations: list[Violation] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_invariant(self) -> dict[str, list[Violation]]:
        out: dict[str, list[Violation]] = {name: [] for name in INVARIANTS}
        for v in self.violations:
            out.setdefault(v.invariant, []).append(v)
        return out


def unsettled(conn: Any) -> list[dict[str, Any]]:
    with conn.cursor() as cur:
        cur.execute("SELECT action_id, status FROM actions WHERE status = ANY(%s::action_status[]) ORDER BY action_id",
                    (list(OPEN_STATUSES),))
        return list(cur.fetchall())


@dataclass
class Quiet:
    reached: bool
    #: Seconds from the start of the wait until the system went quiet for good (or the wait's length).
    seconds: float
    still_open: list[dict[str, Any]]


def wait_quiet(connect: Callable[[], Any], *, quiet_seconds: float = 10.0, max_wait: float = 240.0,
               on_poll: Callable[[int, float], None] | None = None, interval: float = 0.5) -> Quiet:
    """Wait until no action is in an open status for ``quiet_seconds`` in a row, at most ``max_wait``."""
    start = time.monotonic()
    quiet_since: float | None = None
    conn = None
    rows: list[dict[str, Any]] = []
    try:
        while True:
            now = time.monotonic()
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = connect()
                rows = unsettled(conn)
            except Exception:  # noqa: BLE001 - the observer reconnects; a failed poll is not quiet
                conn = None
                rows = [{"action_id": "?", "status": "unobservable"}]
            if rows:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            if on_poll is not None:
                on_poll(len(rows), now - start)
            if quiet_since is not None and now - quiet_since >= quiet_seconds:
                return Quiet(True, round(quiet_since - start, 2), [])
            if now - start >= max_wait:
                return Quiet(False, round(now - start, 2), rows)
            time.sleep(interval)
    finally:
        if conn is not None:
            conn.close()


#: Seconds between the two looks at the advisory locks: a lock seen in both is held, not in use.
LOCK_RECHECK_SECONDS = 5.0
ADVISORY_SQL = """SELECT l.pid, l.classid, l.objid, l.objsubid, a.application_name, a.usename FROM pg_locks l
                  LEFT JOIN pg_stat_activity a ON a.pid = l.pid
                  WHERE l.locktype = 'advisory' AND l.database = %s AND l.granted"""


def held_advisory_locks(cur: Any, oid: int, interval: float = LOCK_RECHECK_SECONDS) -> list[dict[str, Any]]:
    """Advisory locks still held by the same session a few seconds apart. A quiet fleet still runs
    its periodic tasks (the reconcile sweep, a run's coordinator take transaction-scoped locks), so
    one look can catch a lock in use; a leaked lock is there at both looks."""
    def look() -> dict[tuple[Any, ...], dict[str, Any]]:
        cur.execute(ADVISORY_SQL, (oid,))
        return {(r["pid"], r["classid"], r["objid"], r["objsubid"]): r for r in cur.fetchall()}

    first = look()
    if not first:
        return []
    time.sleep(interval)
    second = look()
    return [second[key] for key in first.keys() & second.keys()]


def check(conn: Any, sor_db: Path, submitted: dict[str, dict[str, Any]], conflict_keys: dict[str, str]
          ) -> CheckResult:
    """Check every invariant. ``submitted``: action id -> what the soak published (recorded in the
    ledger by the controller); ``conflict_keys``: key of a conflicting envelope -> its action id."""
    result = CheckResult()
    bad = result.violations.append
    with conn.cursor() as cur:
        cur.execute("""SELECT action_id, run_id, step, kind, parent_action_id, action_type, tool, tenant,
                              idempotency_key, status::text AS status, outcome::text AS outcome, finding, reason_code
                       FROM actions ORDER BY action_id""")
        actions = {r["action_id"]: r for r in cur.fetchall()}
        cur.execute("""SELECT action_id, seq, event, evidence->>'outcome' AS outcome FROM ledger_events
                       ORDER BY action_id, seq""")
        events: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in cur.fetchall():
            events[r["action_id"]].append(r)
        # First per action: the events of the soak's own setup errors (see "configured" below).
        cur.execute("""SELECT DISTINCT ON (action_id) action_id, seq, event FROM ledger_events
                       WHERE evidence::text LIKE '%%configuration_error%%' ORDER BY action_id, seq""")
        misconfigured = list(cur.fetchall())
        cur.execute("SELECT oid FROM pg_database WHERE datname = current_database()")
        oid = cur.fetchone()["oid"]
        advisory = held_advisory_locks(cur, oid)
        cur.execute("SELECT action_id, worker_id, fencing_token, expires_at FROM leases WHERE released_at IS NULL")
        open_leases = list(cur.fetchall())
        cur.execute("""SELECT i.key, i.action_id, i.status::text AS status, a.status::text AS action_status
                       FROM idempotency_records i LEFT JOIN actions a ON a.action_id = i.action_id
                       WHERE i.status IN ('in_progress', 'unknown')""")
        unsettled_records = list(cur.fetchall())
        cur.execute("SELECT scope::text AS scope, value, reason FROM kill_switches WHERE cleared_at IS NULL")
        switches = list(cur.fetchall())

    # --- nothing lost --------------------------------------------------------------------------
    for aid in sorted(set(submitted) - set(actions)):
        bad(Violation("nothing_lost", aid, "published by the soak but not in the ledger"))
    for aid, row in actions.items():
        if row["status"] in OPEN_STATUSES:
            bad(Violation("nothing_lost", aid, f"still {row['status']} after quiet ({row['action_type']}, "
                                               f"outcome {row['outcome']}, reason {row['reason_code']})"))
        elif row["status"] == "escalated":
            names = {e["event"] for e in events.get(aid, [])}
            if not names & EXPLAINING:
                bad(Violation("nothing_lost", aid, f"escalated with no explaining event (reason {row['reason_code']})"))

    # --- effects ---------------------------------------------------------------------------------
    effects = sor.effects(sor_db)
    per_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in effects:
        if e["idempotency_key"] is None:
            if e["tool"] not in BOOKKEEPING_TOOLS:
                bad(Violation("nothing_unexplained", f"effect #{e['seq']}",
                              f"{e['tool']} on {e['resource']} without an idempotency key"))
        else:
            per_key[e["idempotency_key"]].append(e)
    key_to_action = {row["idempotency_key"]: aid for aid, row in actions.items()}
    for key, rows in sorted(per_key.items()):
        owner = key_to_action.get(key)
        if len(rows) > 1:
            bad(Violation("no_duplicates", owner or key,
                          f"{len(rows)} effects for key {key}: " + ", ".join(f"{r['tool']} {r['resource']}" for r in rows)))
        if owner is None:
            why = f" (the conflicting envelope of {conflict_keys[key]})" if key in conflict_keys else ""
            bad(Violation("nothing_unexplained", conflict_keys.get(key, key),
                          f"{len(rows)} effect(s) under key {key}{why} that no ledger action carries: "
                          + ", ".join(f"{r['tool']} {r['resource']}" for r in rows)))
    for aid, row in actions.items():
        n = len(per_key.get(row["idempotency_key"], []))
        if row["outcome"] in HAPPENED and n != 1:
            bad(Violation("no_duplicates", aid, f"ledger says {row['outcome']} but the system of record has {n} "
                                                f"effect(s) for its key"))
        if row["status"] in ("closed", "cancelled") and row["outcome"] in NO_EFFECT and n:
            bad(Violation("nothing_unexplained", aid, f"ledger says {row['status']}/{row['outcome']} "
                                                      f"({row['reason_code']}) but the system of record has {n} effect(s)"))

    # --- unknown outcomes are settled by verification ------------------------------------------
    for aid, chain in events.items():
        last_unknown = None
        for e in chain:
            if (e["event"] == "tool_called" and e["outcome"] == "unknown_outcome") or e["event"] == "reconcile_required":
                last_unknown = e["seq"]
        if last_unknown is None or aid not in actions:
            continue
        if not any(e["event"] == "verification_finished" and e["seq"] > last_unknown for e in chain):
            row = actions[aid]
            if row["status"] not in OPEN_STATUSES:  # an open one is already reported as lost
                bad(Violation("verified_not_guessed", aid, f"unknown outcome (event #{last_unknown}) settled as "
                                                           f"{row['status']}/{row['outcome']} without a verification read"))

    # --- chains, locks, leases -------------------------------------------------------------------
    chains, n_events, broken = check_chains(conn)
    for link in broken:
        bad(Violation("chains_intact", link.action_id, f"event {link.seq}: {link.problem}"))
    for lock in advisory:
        bad(Violation("no_advisory_locks", f"pid {lock['pid']}",
                      f"advisory lock held by {lock['usename']} ({lock['application_name']})"))
    for lease in open_leases:
        bad(Violation("no_open_leases", lease["action_id"], f"lease of {lease['worker_id']} token "
                                                            f"{lease['fencing_token']} never released"))

    # --- the soak's own setup ----------------------------------------------------------------------
    # A read or call refused for the deployment's configuration (a server the contracts name and the
    # servers file lacks) is the soak's defect, not a fault it injected: every such action would
    # escalate "explained", and the run would still look green.
    for e in misconfigured:
        bad(Violation("configured", e["action_id"], f"event #{e['seq']} ({e['event']}) reports a configuration error"))

    # --- figures ---------------------------------------------------------------------------------
    all_events = Counter(e["event"] for chain in events.values() for e in chain)
    result.stats = {
        "ledger_actions": len(actions),
        "by_kind": dict(Counter(r["kind"] for r in actions.values())),
        "by_status_outcome": dict(Counter(f"{r['status']}/{r['outcome']}" for r in actions.values())),
        "by_type_outcome": dict(Counter(f"{r['action_type']}: {r['status']}/{r['outcome']}"
                                        for r in actions.values())),
        "reason_codes": dict(Counter(r["reason_code"] or "-" for r in actions.values())),
        "effects": len(effects),
        "effects_with_key": sum(len(v) for v in per_key.values()),
        "keys_with_more_than_one_effect": sum(1 for v in per_key.values() if len(v) > 1),
        # Conflicting envelopes whose refusal is on the original action's chain (the others were
        # lost with the broker, or ignored while the original held its action lock).
        "conflicts_recorded": sum(1 for aid in set(conflict_keys.values())
                                  if any(e["event"] == "idempotency_conflict" for e in events.get(aid, []))),
        "chains": chains, "events": n_events,
        "advisory_locks": len(advisory), "open_leases": len(open_leases),
        "idempotency_records_unsettled": [dict(r) for r in unsettled_records],
        "kill_switches_active": [dict(r) for r in switches],
        "event_counts": {k: all_events[k] for k in (
            "duplicate_suppressed", "redelivery_ignored", "idempotency_conflict", "publish_refused", "redriven",
            "reconcile_required", "stale_write_refused", "target_busy", "precheck_unavailable", "retry_scheduled",
            "verification_superseded", "redelivery_reenqueued_verification", "early_delivery_ignored",
            "recovery_action_published", "compensated", "compensation_failed", "escalated") if all_events[k]},
    }
    return result
