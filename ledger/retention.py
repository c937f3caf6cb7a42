"""Retention: which settled records may go, and pruning them as a recorded, privileged step.

A whole action chain is pruned, never part of one: the action is settled (``closed`` or
``cancelled``), past its deadline, older than its retention class allows (``actions.retention_class``
when set, else its contract's, else ``standard``), not on legal hold, and its head is exactly the
head the newest verified checkpoint anchored, with the chain itself still verifying. The removal
is ``proofline_prune()`` (ledger/retention_ddl.py), which checks all of that again under row locks
and records the heads it removed; this module only chooses candidates and runs it in batches.

Other tables with a retention class register in ``retention_tables`` (:data:`REGISTERED` names
the ones migrations register) and are pruned by age and class in the same call.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ledger.anchor_keys import load_public_keys
from ledger.anchor_store import store_for
from ledger.checkpoint import latest_valid, ledger_name
from ledger.states import RetentionClass
from proofline.contracts import load_contracts
from proofline.ledger_check import check_chain
from proofline.settings import Settings

log = logging.getLogger(__name__)

#: Chains per ``proofline_prune()`` call (one transaction, one ``ledger_pruned`` event each).
BATCH = 500
#: The tables migrations register in ``retention_tables`` (table, age column, class column, condition).
REGISTERED = (("message_deliveries", "last_at", "retention_class", "unsettled = 0"),)

DAY = 86400.0

CANDIDATES_SQL = """
SELECT action_id, ledger_seq, ledger_head FROM (
  SELECT a.action_id, a.ledger_seq, a.ledger_head, a.updated_at,
         COALESCE(a.retention_class, %(types)s::jsonb->>a.action_type, 'standard') AS cls
    FROM actions a
   WHERE a.status IN ('closed', 'cancelled') AND a.ledger_seq > 0 AND a.deadline < clock_timestamp()) c
 WHERE %(keep)s::jsonb ? c.cls
   AND c.updated_at < clock_timestamp() - make_interval(secs => (%(keep)s::jsonb->>c.cls)::double precision)
 ORDER BY action_id
"""


def keep_seconds(settings: Settings) -> dict[str, float]:
    """How long each class is kept, in seconds; ``legal_hold`` is absent: it is never pruned."""
    return {RetentionClass.short.value: settings.retention_short_days * DAY,
            RetentionClass.standard.value: settings.retention_standard_days * DAY,
            RetentionClass.audit.value: settings.retention_audit_days * DAY}


def contract_classes(settings: Settings) -> dict[str, str]:
    """The retention class each loaded contract names, by action type."""
    return {t: c.retention_class for t, c in load_contracts(settings.contracts_dir).contracts.items()}


def prune(conn: Any, settings: Settings, actor: str, *, dry_run: bool = False) -> dict[str, Any]:
    """Prune (or, with ``dry_run``, count) what retention allows; returns the totals."""
    keep, types = keep_seconds(settings), contract_classes(settings)
    ledger = ledger_name(conn)
    checkpoint = latest_valid(store_for(settings, ledger), load_public_keys(settings), ledger)
    anchored = checkpoint.heads() if checkpoint is not None else {}
    chains: list[tuple[str, int, str]] = []
    not_anchored = broken = 0
    with conn.transaction(), conn.cursor(name="ledger_prune_candidates") as cur:
        cur.itersize = 2000
        cur.execute(CANDIDATES_SQL, {"keep": json.dumps(keep), "types": json.dumps(types)})
        rows = [(r["action_id"], r["ledger_seq"], r["ledger_head"]) for r in cur]
    with conn.cursor() as cur:
        for chain, seq, head in rows:
            if anchored.get(chain) != (seq, head):
                not_anchored += 1  # grown since, or never checkpointed: wait for the next checkpoint
                continue
            if check_chain(cur, chain)[1] is not None:
                broken += 1  # a broken chain is evidence for verify-ledger, never pruned away
                continue
            chains.append((chain, seq, head))
    totals: dict[str, Any] = {"dry_run": dry_run, "checkpoint": checkpoint.number if checkpoint else None,
                              "chains": 0, "events": 0, "skipped": 0, "not_anchored": not_anchored,
                              "broken": broken, "classes": {}, "tables": {}, "heads": []}
    batches = [chains[i:i + BATCH] for i in range(0, len(chains), BATCH)] or [[]]
    for i, batch in enumerate(batches):
        with conn.transaction(), conn.cursor() as cur:
            cur.execute("SELECT proofline_prune(%s, %s, %s, %s, %s, %s, %s, %s) AS done",
                        ([c for c, _, _ in batch], [s for _, s, _ in batch], [h for _, _, h in batch],
                         totals["checkpoint"] or 0, json.dumps(keep), json.dumps(types), actor, dry_run))
            done = cur.fetchone()["done"]
        _add(totals, done, tables=i == 0)  # tables are pruned by the first call (later ones find none)
    log.info("ledger pruned", extra={"event": "ledger_pruned", "dry_run": dry_run, "chains": totals["chains"],
                                     "events": totals["events"], "tables": totals["tables"]})
    return totals


def _add(totals: dict[str, Any], done: dict[str, Any], tables: bool) -> None:
    for key in ("chains", "events", "skipped"):
        totals[key] += int(done.get(key) or 0)
    totals["heads"] += done.get("heads") or []
    for group in ("classes", "tables") if tables else ("classes",):
        for name, n in (done.get(group) or {}).items():
            totals[group][name] = totals[group].get(name, 0) + int(n)


def set_class(conn: Any, action_id: str, retention_class: RetentionClass, by: str, reason: str) -> None:
    """Give one action an explicit class (a legal hold, or lifting it), recorded on its chain."""
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("SELECT proofline_set_retention(%s, %s, %s, %s)", (action_id, retention_class.value, by, reason))
