"""Signed evidence: what a worker recorded about an action, in a statement its worker key signs.

Recovery derives compensations from an action row's state columns (status, outcome, finding,
result, the before/after snapshots in ``recovery_data``). Those columns are written by a database
role, and a database role is no proof of who wrote them. So the worker that decides them also
signs a small statement of them, in the same transaction, as the ``evidence_signed`` ledger event;
recovery reads the latest one back, verifies its signature against the keyring (a worker key, not
revoked) and compares the row with it column by column (:func:`mismatches`).

The statement carries digests of the stored (redacted, jsonb) form of the result and of the
before/after snapshots, not the values, so it stays small and redaction never has to touch it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ledger.redact import Redactor
from ledger.states import ActionStatus, Outcome
from ledger.store import ActionRow, Cursor, stored_form
from proofline.canonical import sha256_hex
from proofline.errors import EvidenceMismatch, EvidenceUnsigned
from proofline.keys import Keyring, SigningKey
from proofline.signing import sign_evidence, verify_evidence

EVENT = "evidence_signed"
FORMAT = "proofline-evidence/1"
#: The part of ``recovery_data`` a recovery action's target and arguments are built from.
SNAPSHOTS = ("before", "after")


def _numbers_as_floats(value: Any) -> Any:
    # jsonb keeps numbers as numeric and gives 1e20 back as an integer: one spelling for both sides.
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:  # an integer no double holds: its digits, the same on both sides
            return f"int:{value}"
    if isinstance(value, dict):
        return {k: _numbers_as_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers_as_floats(v) for v in value]
    return value


def digest(stored: Any) -> str | None:
    """The digest of a value as a jsonb column holds it (``None`` for SQL NULL)."""
    if stored is None:
        return None
    plain = _numbers_as_floats(stored)
    try:
        return "sha256:" + sha256_hex(plain)
    except Exception:  # noqa: BLE001 - what RFC 8785 refuses (a lone surrogate) still gets one stable digest
        return "sha256:" + hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()


def as_stored(value: Any, redactor: Redactor | None = None) -> Any:
    """``value`` as a jsonb column will hold it once the store has written it (redacted, NULs kept
    visible, tuples as lists, anything else as its string)."""
    if value is None:
        return None
    return stored_form(redactor(value) if redactor is not None else value)


def snapshots(recovery_data: dict[str, Any] | None) -> dict[str, Any]:
    data = recovery_data or {}
    return {name: data.get(name) for name in SNAPSHOTS}


def statement(*, action_id: str, idempotency_key: str, status: ActionStatus, outcome: Outcome | None,
              finding: str | None, reason_code: str | None, result: Any, recovery_data: dict[str, Any] | None,
              signer: str) -> dict[str, Any]:
    """The statement of an action's evidence columns; ``result`` and ``recovery_data`` in their stored form."""
    return {"format": FORMAT, "action_id": action_id, "idempotency_key": idempotency_key, "status": status.value,
            "outcome": outcome.value if outcome else None, "finding": finding, "reason_code": reason_code,
            "result": digest(result), "recovery_data": digest(snapshots(recovery_data)), "signer": signer}


def signed_event(key: SigningKey, claims: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The ``evidence_signed`` ledger event for a transition's event list (same transaction)."""
    return EVENT, sign_evidence(claims, key)


def latest_txn(cur: Cursor, action_id: str) -> tuple[dict[str, Any] | None, Any]:
    """The action's latest ``evidence_signed`` evidence and when the ledger stored it."""
    cur.execute("SELECT evidence, at FROM ledger_events WHERE action_id = %s AND event = %s ORDER BY seq DESC "
                "LIMIT 1", (action_id, EVENT))
    row = cur.fetchone()
    return (row["evidence"], row["at"]) if row else (None, None)


def mismatches(row: ActionRow, claims: dict[str, Any], statuses: tuple[ActionStatus, ...]) -> dict[str, Any]:
    """The row's evidence columns that differ from the signed ``claims``, as {column: [row, signed]}.
    ``statuses``: the signed statuses that vouch for the row's current one."""
    have = {"format": FORMAT, "action_id": row.action_id, "idempotency_key": row.idempotency_key,
            "outcome": row.outcome.value if row.outcome else None, "finding": row.finding,
            "result": digest(row.result), "recovery_data": digest(snapshots(row.recovery_data))}
    found = {name: [str(value)[:100], str(claims.get(name))[:100]] for name, value in have.items()
             if claims.get(name) != value}
    if claims.get("status") not in {s.value for s in statuses}:
        found["status"] = [row.status.value, str(claims.get("status"))[:100]]
    return found


def check_txn(cur: Cursor, row: ActionRow, keyring: Keyring, statuses: tuple[ActionStatus, ...]) -> str:
    """Verify the row's latest signed evidence and compare the row with it; returns the worker key id.

    Raises :class:`EvidenceUnsigned` (no statement, or not validly signed by an active worker key)
    or :class:`EvidenceMismatch` (naming the columns that differ). A row written before signed
    evidence existed has no statement: it is refused like a forged one, for an operator to judge."""
    seal, stored_at = latest_txn(cur, row.action_id)
    try:
        key = verify_evidence(seal, keyring, stored_at)
    except EvidenceUnsigned as exc:
        raise EvidenceUnsigned(f"action {row.action_id}: {exc.detail}", action_id=row.action_id,
                               cause=exc.context.get("cause", "missing")) from None
    assert seal is not None
    found = mismatches(row, seal["statement"], statuses)
    if found:
        raise EvidenceMismatch(f"action row {row.action_id} differs from its signed evidence in "
                               f"{', '.join(sorted(found))}", action_id=row.action_id,
                               columns=", ".join(sorted(found)), mismatches=found, key_id=key.key_id)
    return key.key_id
