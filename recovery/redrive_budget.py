"""A fleet-wide budget for re-sending published actions: no faster than the workers drain.

The reconciler re-sends a published action nobody started (``not_started``) on the reasoning that
the broker lost its message. Each action backs off on its own (the claim's ``next_check_at``), and
``recovery/backlog.py`` leaves alone what may still wait in a readable queue; neither bounds the
fleet's rate. After a long fault, thousands of actions are due at once and a sweep re-sent its
whole limit every period: in the 10,000-item soak, 805 sweeps re-sent 200 each, about 10,000
messages a minute against 2,430 published actions, every copy a delivery a worker had to open and
suppress while the work it was meant to recover waited behind it.

So each sweep re-sends at most a budget of ``not_started`` actions, from two measures the ledger
holds (whatever the broker):

- the drain: the leases taken (executions started, which is how an action leaves ``published``)
  over the last :func:`window_seconds`, as a rate, over the time since the previous sweep finished
  (at least the period, at most the window: under load a sweep's task may expire unrun for many
  periods, and the budget must not fall behind the drain);
- the re-sends still waiting: actions re-sent within the window and still ``published``, the
  reconciler's own share of the queues' depth.

The budget is twice the drain (times ``redrive_budget_share``) less what still waits: while the
workers take every re-send at once (all of them lost, the workers idle), the budget doubles with
each window; once re-sends queue up, it falls back, and at most about two spans' worth of re-sent
messages wait ahead of the workers. Never fewer than ``redrive_budget_min`` per sweep, so lost
messages are still sent while nothing drains. The actions left over stay due and are taken, oldest
check first, by the next sweeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ledger import store

#: Leases taken in the window (a range read of ``leases_acquired_idx``, migration 0024), the
#: re-sends of the window that still wait (published actions only, ``actions_status_idx``) and the
#: seconds since the sweep's last finished run (the run in progress is not finished).
MEASURE_SQL = """
SELECT (SELECT count(*) FROM leases
        WHERE acquired_at > clock_timestamp() - make_interval(secs => %(window)s)) AS started,
       (SELECT count(*) FROM actions a WHERE a.status = 'published' AND a.recovery_data ? 'sent_at'
          AND (a.recovery_data->>'sent_at')::timestamptz > clock_timestamp() - make_interval(secs => %(window)s))
        AS waiting,
       (SELECT extract(epoch FROM clock_timestamp() - r.finished_at) FROM sweep_runs r
        WHERE r.sweep = %(sweep)s AND r.finished_at IS NOT NULL ORDER BY r.slot DESC LIMIT 1) AS since_last
"""

#: The drain is measured over this many sweep periods, and never less than MIN_WINDOW_SECONDS
#: (one slow period says little about the fleet).
WINDOW_PERIODS = 6
MIN_WINDOW_SECONDS = 30.0
#: The budget's headroom over the measured drain: what lets it grow while the workers keep up.
HEADROOM = 2.0


@dataclass(frozen=True)
class Budget:
    """What one sweep may re-send, and the measures it came from (stamped on the sweep's counts)."""

    #: Executions started over the window (leases taken).
    started: int
    #: Actions re-sent within the window and not started yet.
    waiting: int
    window_seconds: float
    #: The time the budget covers: since the previous sweep finished, within [period, window].
    span_seconds: float
    #: ``not_started`` actions this sweep may re-send.
    limit: int

    @property
    def drain_per_second(self) -> float:
        return self.started / self.window_seconds


def window_seconds(period_seconds: float) -> float:
    return max(WINDOW_PERIODS * period_seconds, MIN_WINDOW_SECONDS)


def limit_for(started: int, waiting: int, window: float, span_seconds: float, share: float, floor: int,
              cap: int) -> int:
    """The budget: twice the drain over ``span_seconds``, times ``share``, less the re-sends still
    waiting; at least ``floor``, at most ``cap`` (the sweep's own limit)."""
    room = HEADROOM * started / window * span_seconds * share - waiting
    return max(0, min(cap, max(floor, math.ceil(room))))


def measure_txn(cur: store.Cursor, *, sweep: str, period_seconds: float, share: float, floor: int,
                cap: int) -> Budget:
    """Read the drain from the ledger (inside the sweep's transaction) and derive the budget."""
    window = window_seconds(period_seconds)
    cur.execute(MEASURE_SQL, {"window": window, "sweep": sweep})
    row = cur.fetchone()
    started = int(row["started"]) if row else 0
    waiting = int(row["waiting"]) if row else 0
    since = float(row["since_last"]) if row and row["since_last"] is not None else period_seconds
    span = min(max(since, period_seconds), window)
    return Budget(started=started, waiting=waiting, window_seconds=window, span_seconds=span,
                  limit=limit_for(started, waiting, window, span, share, floor, cap))
