"""Accounts and refunds: ``issue_refund`` ignores the key; ``reverse_refund`` compensates idempotently."""

from __future__ import annotations

from typing import Any

from proofline_kit.sor.core import PathLike, Refused, plan_document, record_effect, settle
from proofline_kit.sor.db import next_id, now, reading, writing


def issue_refund(
    path: PathLike,
    account: str,
    tenant: str,
    amount_cents: int,
    reason: str,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    """Pay a refund out of ``account`` (key recorded, not honoured: every call refunds again).

    Returns ``{"refund_id", "account", "amount_cents", "balance_cents"}``; raises ``Refused``.
    """
    if amount_cents <= 0:
        raise Refused("invalid_amount", "amount_cents must be positive")
    with writing(path) as conn:
        settle(conn)
        acct = conn.execute("SELECT * FROM accounts WHERE id = ?", (account,)).fetchone()
        if acct is None:
            raise Refused("not_found", f"no account {account}")
        if acct["tenant"] != tenant:
            raise Refused("tenant_mismatch", f"account {account} does not belong to tenant {tenant}")
        if acct["balance_cents"] < amount_cents:
            raise Refused("insufficient_balance", f"balance {acct['balance_cents']} < {amount_cents}")
        refund_id = next_id(conn, "refunds", "R")
        balance = acct["balance_cents"] - amount_cents
        conn.execute(
            "INSERT INTO refunds (id, account, tenant, amount_cents, reason, status, idempotency_key, created_at)"
            " VALUES (?, ?, ?, ?, ?, 'issued', ?, ?)",
            (refund_id, account, tenant, amount_cents, reason, idempotency_key, now()),
        )
        conn.execute(
            "UPDATE accounts SET balance_cents = ?, version = version + 1 WHERE id = ?", (balance, account)
        )
        record_effect(
            conn,
            "issue_refund",
            idempotency_key,
            f"refund:{refund_id}",
            {"account": account, "amount_cents": amount_cents, "balance_cents": balance},
        )
        return {
            "refund_id": refund_id,
            "account": account,
            "amount_cents": amount_cents,
            "balance_cents": balance,
        }


def reverse_refund(path: PathLike, refund_id: str, idempotency_key: str | None = None) -> dict[str, Any]:
    """Compensate a refund: mark it reversed and give the amount back to the account.

    Idempotent: a refund already reversed (by this key or any other) is returned with
    ``deduplicated: True`` and nothing applied. Returns ``{"refund_id", "status", "deduplicated"}``.
    """
    with writing(path) as conn:
        settle(conn)
        refund = conn.execute("SELECT * FROM refunds WHERE id = ?", (refund_id,)).fetchone()
        if refund is None:
            raise Refused("not_found", f"no refund {refund_id}")
        if refund["status"] == "reversed":
            return {"refund_id": refund_id, "status": "reversed", "deduplicated": True}
        conn.execute(
            "UPDATE refunds SET status = 'reversed', reversal_key = ? WHERE id = ?",
            (idempotency_key, refund_id),
        )
        conn.execute(
            "UPDATE accounts SET balance_cents = balance_cents + ?, version = version + 1 WHERE id = ?",
            (refund["amount_cents"], refund["account"]),
        )
        record_effect(
            conn,
            "reverse_refund",
            idempotency_key,
            f"refund:{refund_id}",
            {"account": refund["account"], "amount_cents": refund["amount_cents"]},
        )
        return {"refund_id": refund_id, "status": "reversed", "deduplicated": False}


def get_account(path: PathLike, account: str) -> dict[str, Any]:
    """``{"found": bool, "account": {...} | None, "refunds": [...]}`` (refunds oldest first)."""
    with reading(path) as conn:
        acct = conn.execute("SELECT * FROM accounts WHERE id = ?", (account,)).fetchone()
        refunds = conn.execute(
            "SELECT * FROM refunds WHERE account = ? ORDER BY CAST(SUBSTR(id, 3) AS INTEGER)", (account,)
        ).fetchall()
    return {
        "found": acct is not None,
        "account": dict(acct) if acct else None,
        "refunds": [dict(r) for r in refunds],
    }


def find_refund_by_key(path: PathLike, idempotency_key: str) -> dict[str, Any]:
    """``{"found": bool, "refund": first | None, "refunds": [all]}``: the key is not unique for refunds."""
    with reading(path) as conn:
        rows = conn.execute(
            "SELECT * FROM refunds WHERE idempotency_key = ? ORDER BY CAST(SUBSTR(id, 3) AS INTEGER)",
            (idempotency_key,),
        ).fetchall()
    refunds = [dict(r) for r in rows]
    return {"found": bool(refunds), "refund": refunds[0] if refunds else None, "refunds": refunds}


def preview_refund(path: PathLike, account: str, amount_cents: int) -> dict[str, Any]:
    """What ``issue_refund`` would change now, read-only (the prepare tool of ``refund.issue``).

    Returns ``{"plan_id", "tool", "target", "target_version", "applicable", "refusal", "changes"}``:
    the balance before and after and the account version; a refund that would be refused
    (``invalid_amount``, ``not_found``, ``insufficient_balance``) has ``applicable`` false and no
    changes. The plan id names the account, its version and the amount.
    """
    with reading(path) as conn:
        acct = conn.execute("SELECT * FROM accounts WHERE id = ?", (account,)).fetchone()
    version = acct["version"] if acct is not None else None
    refusal = ("invalid_amount" if amount_cents <= 0 else "not_found" if acct is None
               else "insufficient_balance" if acct["balance_cents"] < amount_cents else None)
    changes = [] if refusal else [
        {"field": "balance_cents", "before": acct["balance_cents"], "after": acct["balance_cents"] - amount_cents},
        {"field": "version", "before": version, "after": version + 1},
    ]
    return plan_document("issue_refund", f"account:{account}", f"issue_refund:{account}@{version}:{amount_cents}",
                         version, refusal, changes)
