"""The Postgres store behind the ledger: every function takes a cursor inside the caller's
transaction (``*_txn``) so that a state change and its ledger event always commit together.

Driver errors are wrapped here and nowhere else.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from ledger.redact import redact
from ledger.states import ActionStatus, IdempotencyStatus, Outcome
from proofline.errors import StaleLease, TransitionRefused

Cursor = psycopg.Cursor[dict[str, Any]]


def connect(url: str, **options: Any) -> psycopg.Connection[dict[str, Any]]:
    """One autocommit connection; callers open explicit transactions with :func:`transaction`."""
    conn = psycopg.connect(url, autocommit=True, row_factory=dict_row, **options)
    return conn


@contextmanager
def transaction(conn: psycopg.Connection[dict[str, Any]]) -> Iterator[Cursor]:
    with conn.transaction(), conn.cursor() as cur:
        yield cur


# An escaped NUL in JSON text: "\u0000" preceded by an even number of backslashes.
_NUL = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def _dumps(value: Any) -> str:
    # jsonb cannot hold U+0000. Keep it visible as the six characters "\u0000" instead of failing
    # the whole write: a hostile NUL must still leave a record.
    return _NUL.sub(r"\1\\\\u0000", json.dumps(value, default=str))


def _json(value: Any) -> Jsonb:
    return Jsonb(value, dumps=_dumps)


# --- ledger events ------------------------------------------------------------------------------


def append_event_txn(
    cur: Cursor,
    action_id: str,
    event: str,
    actor: str,
    evidence: dict[str, Any] | None = None,
    redact_fields: Iterable[str] = (),
) -> None:
    """Append one event to an action's chain (the trigger assigns seq and hashes)."""
    clean = redact(evidence or {}, frozenset(f.lower() for f in redact_fields))
    cur.execute(
        "INSERT INTO ledger_events (action_id, event, actor, evidence) VALUES (%s, %s, %s, %s)",
        (action_id, event, actor, _json(clean)),
    )


def append_events_txn(cur: Cursor, action_id: str, actor: str, events: list[tuple[str, dict[str, Any]]],
                      redact_fields: Iterable[str] = ()) -> None:
    """Append several events in order with one statement per event (same transaction)."""
    fields = frozenset(f.lower() for f in redact_fields)
    cur.executemany(
        "INSERT INTO ledger_events (action_id, event, actor, evidence) VALUES (%s, %s, %s, %s)",
        [(action_id, name, actor, _json(redact(ev, fields))) for name, ev in events],
    )


# --- actions ----------------------------------------------------------------------------------------


def signed_message_of(envelope: dict[str, Any], key_id: str | None, signature: str | None,
                      signed_canonical: bytes | memoryview | None) -> dict[str, Any] | None:
    """The signed message of an action row: its exact canonical bytes when recorded (rows written
    before migration 0008 fall back to the jsonb copy)."""
    if signed_canonical is not None:
        return json.loads(bytes(signed_canonical))
    if not signature:
        return None
    return {"envelope": envelope, "key_id": key_id, "signature": signature}


@dataclass(frozen=True)
class ActionRow:
    action_id: str
    run_id: str
    step: int
    tenant: str
    action_type: str
    tool: str
    idempotency_key: str
    status: ActionStatus
    outcome: Outcome | None
    finding: str | None
    reason_code: str | None
    envelope: dict[str, Any]
    result: dict[str, Any] | None
    recovery_data: dict[str, Any]
    deadline: datetime
    published_at: datetime
    updated_at: datetime
    kind: str = "action"
    parent_action_id: str | None = None
    key_id: str | None = None
    signature: str | None = None
    recovery_kind: str | None = None
    cancel_requested_at: datetime | None = None
    signed_canonical: bytes | None = None

    @property
    def signed_message(self) -> dict[str, Any] | None:
        """The controller's original signed message, when it was recorded: decoded from its exact
        canonical bytes (``envelope`` is a jsonb copy, which cannot hold every string unchanged)."""
        return signed_message_of(self.envelope, self.key_id, self.signature, self.signed_canonical)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ActionRow:
        return cls(
            action_id=row["action_id"], run_id=row["run_id"], step=row["step"], tenant=row["tenant"],
            action_type=row["action_type"], tool=row["tool"], idempotency_key=row["idempotency_key"],
            status=ActionStatus(row["status"]), outcome=Outcome(row["outcome"]) if row["outcome"] else None,
            finding=row["finding"], reason_code=row["reason_code"], envelope=row["envelope"],
            result=row["result"], recovery_data=row["recovery_data"], deadline=row["deadline"],
            published_at=row["published_at"], updated_at=row["updated_at"],
            kind=row.get("kind", "action"), parent_action_id=row.get("parent_action_id"),
            key_id=row.get("key_id"), signature=row.get("signature"), recovery_kind=row.get("recovery_kind"),
            cancel_requested_at=row.get("cancel_requested_at"),
            signed_canonical=bytes(row["signed_canonical"]) if row.get("signed_canonical") is not None else None,
        )


def insert_action_txn(cur: Cursor, envelope: dict[str, Any], *, key_id: str | None = None,
                      signature: str | None = None, task_id: str | None = None,
                      status: ActionStatus = ActionStatus.published, kind: str = "action",
                      parent_action_id: str | None = None, signed_canonical: bytes | None = None) -> bool:
    """Record a newly published action; False when the action id is already known.

    ``signed_canonical`` is the signed message as canonical JSON bytes, kept byte for byte."""
    cur.execute(
        """INSERT INTO actions (action_id, run_id, step, tenant, action_type, server, tool,
                               idempotency_key, status, envelope, deadline, key_id, signature, task_id,
                               kind, parent_action_id, signed_canonical)
           VALUES (%(action_id)s, %(run_id)s, %(step)s, %(tenant)s, %(action_type)s, %(server)s,
                   %(tool)s, %(idempotency_key)s, %(status)s, %(envelope)s, %(deadline)s, %(key_id)s,
                   %(signature)s, %(task_id)s, %(kind)s, %(parent)s, %(signed)s)
           ON CONFLICT (action_id) DO NOTHING RETURNING action_id""",
        {"key_id": key_id, "signature": signature, "task_id": task_id, "status": status.value, "kind": kind,
         "parent": parent_action_id, "signed": signed_canonical,
            "action_id": envelope["action_id"], "run_id": envelope["run_id"], "step": envelope.get("step", 0),
            "tenant": envelope["tenant"], "action_type": envelope["action_type"],
            "server": envelope["server"]["name"], "tool": envelope["tool"]["name"],
            "idempotency_key": envelope["idempotency_key"], "envelope": _json(envelope),
            "deadline": envelope["deadline"],
        },
    )
    return cur.fetchone() is not None


def transition_txn(
    cur: Cursor,
    action_id: str,
    allowed: Iterable[ActionStatus],
    status: ActionStatus,
    *,
    outcome: Outcome | None = None,
    finding: str | None = None,
    reason_code: str | None = None,
    result: dict[str, Any] | None = None,
    recovery_data: dict[str, Any] | None = None,
    recovery_kind: Any = None,
) -> ActionRow:
    """Move an action to ``status`` only from one of ``allowed``; raise when no row moved."""
    allowed_values = [s.value for s in allowed]
    cur.execute(
        """UPDATE actions SET status = %(status)s,
               outcome = COALESCE(%(outcome)s::outcome_class, outcome),
               finding = COALESCE(%(finding)s, finding),
               reason_code = COALESCE(%(reason)s, reason_code),
               result = COALESCE(%(result)s, result),
               recovery_data = recovery_data || %(recovery)s,
               recovery_kind = COALESCE(%(kind)s::recovery_kind, recovery_kind),
               updated_at = clock_timestamp()
           WHERE action_id = %(id)s AND status = ANY(%(allowed)s::action_status[])
           RETURNING *""",
        {
            "status": status.value, "outcome": outcome.value if outcome else None, "finding": finding,
            "reason": reason_code, "result": _json(result) if result is not None else None,
            "recovery": _json(recovery_data or {}), "id": action_id, "allowed": allowed_values,
            "kind": recovery_kind.value if recovery_kind is not None else None,
        },
    )
    row = cur.fetchone()
    if row is None:
        cur.execute("SELECT status FROM actions WHERE action_id = %s", (action_id,))
        current = cur.fetchone()
        raise TransitionRefused(
            f"{action_id}: {current['status'] if current else 'missing'} -> {status.value} not allowed",
            action_id=action_id,
        )
    return ActionRow.from_row(row)


def get_action(cur: Cursor, action_id: str) -> ActionRow | None:
    cur.execute("SELECT * FROM actions WHERE action_id = %s", (action_id,))
    row = cur.fetchone()
    return ActionRow.from_row(row) if row else None


def timeline(cur: Cursor, action_id: str) -> list[dict[str, Any]]:
    cur.execute(
        "SELECT seq, at, event, actor, evidence, hash FROM ledger_events WHERE action_id = %s ORDER BY seq",
        (action_id,),
    )
    return list(cur.fetchall())


# --- idempotency records ------------------------------------------------------------------------


@dataclass(frozen=True)
class IdempotencyRecord:
    key: str
    action_id: str
    argument_hash: str
    contract_hash: str
    status: IdempotencyStatus
    fencing_token: int
    attempts: int
    result: dict[str, Any] | None
    expired: bool


def claim_idempotency_txn(
    cur: Cursor, *, key: str, action_id: str, tenant: str, argument_hash: str, contract_hash: str,
    fencing_token: int, replay_window_seconds: float,
) -> tuple[bool, IdempotencyRecord]:
    """Claim first: insert the record; on conflict load it so the caller can dispatch on it."""
    cur.execute(
        """INSERT INTO idempotency_records (key, action_id, tenant, argument_hash, contract_hash, status,
                                           fencing_token, expires_at)
           VALUES (%s, %s, %s, %s, %s, 'in_progress', %s, clock_timestamp() + make_interval(secs => %s))
           ON CONFLICT (key) DO NOTHING
           RETURNING *, false AS expired""",
        (key, action_id, tenant, argument_hash, contract_hash, fencing_token, replay_window_seconds),
    )
    row = cur.fetchone()
    if row is not None:
        return True, _idem(row)
    cur.execute(
        "SELECT *, expires_at < clock_timestamp() AS expired FROM idempotency_records WHERE key = %s FOR UPDATE",
        (key,),
    )
    return False, _idem(cur.fetchone())


def _idem(row: dict[str, Any] | None) -> IdempotencyRecord:
    assert row is not None
    return IdempotencyRecord(
        key=row["key"], action_id=row["action_id"], argument_hash=row["argument_hash"],
        contract_hash=row["contract_hash"], status=IdempotencyStatus(row["status"]),
        fencing_token=row["fencing_token"], attempts=row["attempts"], result=row["result"],
        expired=row["expired"],
    )


def update_idempotency_txn(
    cur: Cursor, key: str, *, fencing_token: int, allowed: Iterable[IdempotencyStatus],
    status: IdempotencyStatus, result: dict[str, Any] | None = None, new_token: int | None = None,
    count_attempt: bool = False,
) -> int:
    """Guarded update: only the holder of the current fencing token may move the record."""
    cur.execute(
        """UPDATE idempotency_records SET status = %(status)s, result = COALESCE(%(result)s, result),
               fencing_token = COALESCE(%(new_token)s, fencing_token),
               attempts = attempts + %(attempt)s, updated_at = clock_timestamp()
           WHERE key = %(key)s AND fencing_token = %(token)s
             AND status = ANY(%(allowed)s::idempotency_status[])
           RETURNING attempts""",
        {
            "status": status.value, "result": _json(result) if result is not None else None,
            "new_token": new_token, "attempt": 1 if count_attempt else 0, "key": key, "token": fencing_token,
            "allowed": [s.value for s in allowed],
        },
    )
    row = cur.fetchone()
    if row is None:
        raise StaleLease(f"idempotency record {key} is not held by fencing token {fencing_token}", key=key)
    return int(row["attempts"])


def settle_idempotency_txn(cur: Cursor, key: str, status: IdempotencyStatus, evidence: dict[str, Any]) -> None:
    """Verification's verdict on a record. The action row's guarded transition (same transaction)
    is what serialises verifiers, so no fencing token is needed here."""
    cur.execute(
        """UPDATE idempotency_records SET status = %s, result = COALESCE(result, '{}'::jsonb) || %s,
                  updated_at = clock_timestamp() WHERE key = %s""",
        (status.value, _json(evidence), key),
    )


def get_idempotency_txn(cur: Cursor, key: str) -> IdempotencyRecord | None:
    cur.execute("SELECT *, expires_at < clock_timestamp() AS expired FROM idempotency_records WHERE key = %s", (key,))
    row = cur.fetchone()
    return _idem(row) if row else None


# --- revocations and kill switches -----------------------------------------------------------------


def revoke_identity_txn(cur: Cursor, identity: str, by: str, reason: str) -> None:
    cur.execute(
        "INSERT INTO revoked_identities (identity, revoked_by, reason) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
        (identity, by, reason),
    )
