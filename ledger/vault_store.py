"""The protected evidence store: sealed captures in, and the auditor's reads out, each read a
ledger event in the same transaction.

Writing (the worker's role, INSERT only): :func:`write` stores the sealed rows and the
``evidence_captured`` event on the action's chain, which names each capture with its kind, key id,
retention class and plaintext digest: the ledger proves what was captured without holding it.

Reading (``proofline_auditor`` only): :func:`read` selects the rows, opens each with the auditor's
private key, checks it against the digest the ledger recorded, and appends
``evidence_read_by_auditor`` naming the reader and every capture read, before it commits. A role
the store refuses is ``auditor_role_required``; nothing is decrypted without the auditor's key.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from ledger import store
from ledger.store import Cursor
from proofline.auditor_keys import AuditorKey
from proofline.errors import (
    AuditorRoleRequired,
    EvidenceCaptureNotFound,
    EvidenceCaptureTampered,
    PrivilegeRefused,
    ProoflineError,
)
from proofline.vault import Sealed, open_sealed

CAPTURED = "evidence_captured"
READ = "evidence_read_by_auditor"
_COLUMNS = ("capture_id, action_id, kind, key_id, ephemeral_public, nonce, ciphertext, plaintext_sha256, retention, "
            "captured_by, captured_at")


@dataclass(frozen=True)
class Opened:
    """One capture as the auditor reads it."""

    capture_id: str
    action_id: str
    kind: str
    key_id: str
    retention: str
    captured_by: str
    captured_at: datetime
    plaintext_sha256: str
    value: Any

    def as_json(self) -> dict[str, Any]:
        return {"capture_id": self.capture_id, "action_id": self.action_id, "kind": self.kind,
                "key_id": self.key_id, "retention": self.retention, "captured_by": self.captured_by,
                "captured_at": self.captured_at.isoformat(), "sha256": self.plaintext_sha256, "value": self.value}


def captured_event(items: list[Sealed], retention: str) -> tuple[str, dict[str, Any]]:
    """The ledger event that records ``items`` without their values."""
    return CAPTURED, {"captures": [{"capture_id": i.capture_id, "kind": i.kind, "key_id": i.key_id,
                                    "sha256": i.plaintext_sha256, "bytes": len(i.ciphertext)} for i in items],
                      "retention": retention}


def insert_txn(cur: Cursor, items: list[Sealed], retention: str, captured_by: str) -> None:
    """Insert sealed rows (no RETURNING: the writer's role may not read the store)."""
    cur.executemany(
        "INSERT INTO evidence_captures (capture_id, action_id, kind, key_id, ephemeral_public, nonce, ciphertext, "
        "plaintext_sha256, retention, captured_by) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
        [(i.capture_id, i.action_id, i.kind, i.key_id, i.ephemeral_public, i.nonce, i.ciphertext,
          i.plaintext_sha256, retention, captured_by) for i in items])


def write(conn: psycopg.Connection[dict[str, Any]], action_id: str, items: list[Sealed], retention: str,
          actor: str) -> None:
    """Store ``items`` and their ``evidence_captured`` event on ``action_id``'s chain: one commit."""
    if not items:
        return
    with store.transaction(conn) as cur:
        insert_txn(cur, items, retention, actor)
        name, evidence = captured_event(items, retention)
        store.append_event_txn(cur, action_id, name, actor, evidence)


def _rows_txn(cur: Cursor, action_id: str | None, capture_id: str | None) -> list[dict[str, Any]]:
    if capture_id is not None:
        cur.execute(f"SELECT {_COLUMNS} FROM evidence_captures WHERE capture_id = %s", (capture_id,))
    else:
        cur.execute(f"SELECT {_COLUMNS} FROM evidence_captures WHERE action_id = %s ORDER BY captured_at, capture_id",
                    (action_id,))
    return cur.fetchall()


def _recorded_txn(cur: Cursor, action_id: str) -> dict[str, str]:
    """capture id -> the plaintext digest the ledger's ``evidence_captured`` events recorded."""
    cur.execute("SELECT evidence FROM ledger_events WHERE action_id = %s AND event = %s", (action_id, CAPTURED))
    return {c.get("capture_id"): c.get("sha256") for row in cur.fetchall()
            for c in (row["evidence"] or {}).get("captures", []) if isinstance(c, dict)}


def _open(key: AuditorKey, row: dict[str, Any], recorded: dict[str, str]) -> Opened:
    item = Sealed(row["capture_id"], row["action_id"], row["kind"], row["key_id"], bytes(row["ephemeral_public"]),
                  bytes(row["nonce"]), bytes(row["ciphertext"]), row["plaintext_sha256"])
    if recorded.get(item.capture_id) != item.plaintext_sha256:
        raise EvidenceCaptureTampered(f"capture {item.capture_id} is not the one the ledger recorded for action "
                                      f"{item.action_id}", capture_id=item.capture_id, action_id=item.action_id)
    value = open_sealed(key, item)
    return Opened(item.capture_id, item.action_id, item.kind, item.key_id, row["retention"], row["captured_by"],
                  row["captured_at"], item.plaintext_sha256, value)


def read(conn: psycopg.Connection[dict[str, Any]], key: AuditorKey, reader: str, *, action_id: str | None = None,
         capture_id: str | None = None, via: str = "cli") -> list[Opened]:
    """Read and open an action's captures (or one capture), recording the read on the action's
    chain in the same transaction. A capture that fails to open is recorded as attempted and
    raises after the commit (:class:`EvidenceCaptureTampered` or ``auditor_key_required``)."""
    if (action_id is None) == (capture_id is None):
        raise ValueError("name an action id or a capture id")
    failure: ProoflineError | None = None
    try:
        with store.transaction(conn) as cur:
            rows = _rows_txn(cur, action_id, capture_id)
            if not rows:
                raise EvidenceCaptureNotFound(f"no captured evidence for {'capture ' + capture_id if capture_id else 'action ' + str(action_id)}",
                                              action_id=action_id or "", capture_id=capture_id or "")
            chain = rows[0]["action_id"]
            recorded = _recorded_txn(cur, chain)
            opened: list[Opened] = []
            failed: dict[str, str] = {}
            for row in rows:
                try:
                    opened.append(_open(key, row, recorded))
                except ProoflineError as exc:
                    failed[row["capture_id"]] = exc.code
                    failure = failure or exc
            store.append_event_txn(cur, chain, READ, reader, {
                "reader": reader, "via": via, "key_id": key.key_id, "captures": [r["capture_id"] for r in rows],
                "opened": [o.capture_id for o in opened], **({"failed": failed} if failed else {})})
    except psycopg.errors.InsufficientPrivilege as exc:
        raise AuditorRoleRequired(f"the evidence store refused this database role: {exc.diag.message_primary}; "
                                  "read it as proofline_auditor (PROOFLINE_AUDITOR_DATABASE_URL)") from None
    except PrivilegeRefused as exc:
        raise AuditorRoleRequired(f"the ledger refused this role the read's record: {exc.detail}") from None
    if failure is not None:
        raise failure
    return opened
