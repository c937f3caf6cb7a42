"""Read-only listings for operators: actions by status, outcome, tenant, action type and age, and
runs with the outcome derived from their steps. Paged by keyset (``published_at``, ``action_id``),
newest first, so a page never shifts while new actions arrive."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

ACTION_COLUMNS = ("action_id, run_id, step, tenant, action_type, tool, kind, status, outcome, finding, reason_code, "
                  "published_at, updated_at")


@dataclass(frozen=True)
class ActionFilter:
    """What ``proofline actions list`` narrows by; ``None`` means any."""

    status: tuple[str, ...] = ()
    outcome: tuple[str, ...] = ()
    tenant: str | None = None
    action_type: str | None = None
    since: datetime | None = None
    #: Published before this (the console's time range ends here).
    until: datetime | None = None
    run_id: str | None = None
    #: Keyset cursor: only actions published before this (published_at, action_id).
    before: tuple[datetime, str] | None = None


def list_actions(cur: Any, flt: ActionFilter, limit: int) -> list[dict[str, Any]]:
    """Newest first, at most ``limit`` rows."""
    where, params = ["TRUE"], {"limit": limit}
    if flt.status:
        where.append("status::text = ANY(%(status)s)")
        params["status"] = list(flt.status)
    if flt.outcome:
        where.append("outcome::text = ANY(%(outcome)s)")
        params["outcome"] = list(flt.outcome)
    for name in ("tenant", "action_type", "run_id"):
        value = getattr(flt, name)
        if value is not None:
            where.append(f"{name} = %({name})s")
            params[name] = value
    if flt.since is not None:
        where.append("published_at >= %(since)s")
        params["since"] = flt.since
    if flt.until is not None:
        where.append("published_at < %(until)s")
        params["until"] = flt.until
    if flt.before is not None:
        where.append("(published_at, action_id) < (%(before_at)s, %(before_id)s)")
        params["before_at"], params["before_id"] = flt.before
    cur.execute(f"SELECT {ACTION_COLUMNS} FROM actions WHERE {' AND '.join(where)} "
                "ORDER BY published_at DESC, action_id DESC LIMIT %(limit)s", params)
    return list(cur.fetchall())


def list_runs(cur: Any, *, tenant: str | None, since: datetime | None, limit: int) -> list[dict[str, Any]]:
    """Runs newest first: their steps' count and statuses (the outcome is derived by the caller)."""
    where, params = ["kind = 'action'"], {"limit": limit}
    if tenant is not None:
        where.append("tenant = %(tenant)s")
        params["tenant"] = tenant
    if since is not None:
        where.append("published_at >= %(since)s")
        params["since"] = since
    cur.execute(f"""SELECT run_id, min(tenant) AS tenant, count(*) AS steps, min(published_at) AS published_at,
                           max(updated_at) AS updated_at
                    FROM actions WHERE {' AND '.join(where)}
                    GROUP BY run_id ORDER BY min(published_at) DESC, run_id DESC LIMIT %(limit)s""", params)
    return list(cur.fetchall())
