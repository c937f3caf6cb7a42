"""The Postgres store behind the ledger: every function takes a cursor inside the caller's
transaction (``*_txn``) so that a state change and its ledger event always commit together.

Driver errors are wrapped here and nowhere else.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NoReturn

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from ledger import seal
from ledger.redact import POLICY, Redactor, as_redactor, for_envelope
from ledger.states import ActionStatus, IdempotencyStatus, Outcome
from proofline.errors import ConfigurationError, LeaseBusy, PrivilegeRefused, StaleLease, TransitionRefused
from proofline.telemetry import observe

Cursor = psycopg.Cursor[dict[str, Any]]


def connect(url: str, **options: Any) -> psycopg.Connection[dict[str, Any]]:
    """One autocommit connection; callers open explicit transactions with :func:`transaction`.

    A URL libpq cannot parse is a configuration error (``configuration_error``), not a defect; its
    text is not repeated, since a mangled URL may still hold a password."""
    try:
        return psycopg.connect(url, autocommit=True, row_factory=dict_row, **options)
    except psycopg.ProgrammingError:
        raise ConfigurationError("the database URL is not a PostgreSQL connection URL (libpq cannot parse it; "
                                 "expected postgresql://USER[:PASSWORD]@HOST:PORT/DATABASE)") from None


@contextmanager
def transaction(conn: psycopg.Connection[dict[str, Any]]) -> Iterator[Cursor]:
    """One transaction (a savepoint inside another). A read still held open by
    :func:`begin_with_read` is ended first: it wrote nothing, and a write that is not its
    continuation (:func:`pipelined` with ``begun=True``) commits on its own."""
    end_held_read(conn)
    with observe.Watch() as watch:
        try:
            with conn.transaction(), conn.cursor() as cur:
                yield cur
                watch.prepare(cur)
        except psycopg.Error as exc:
            _raise_domain_error(exc)


def begin_with_read(conn: psycopg.Connection[dict[str, Any]], sql: str, params: tuple) -> dict[str, Any] | None:
    """Open a transaction with a read, in one flight (``BEGIN`` and the statement); returns its first
    row. The caller finishes it with :func:`pipelined` (``begun=True``) or :func:`roll_back`. Under
    read committed an open transaction that has written nothing holds no row lock and no snapshot
    between statements: keeping it open costs the server nothing but the session."""
    end_held_read(conn)
    cur = conn.cursor()
    try:
        with conn.pipeline():
            cur.execute("BEGIN")
            cur.execute(sql, params)
        row = cur.fetchone()
    except BaseException:
        roll_back(conn)
        raise
    _held_reads.add(conn)
    return row


#: Connections with a transaction :func:`begin_with_read` opened and nobody finished yet.
_held_reads: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()


def holds_read(conn: psycopg.Connection[dict[str, Any]]) -> bool:
    """Whether the transaction :func:`begin_with_read` opened on ``conn`` is still open and usable.
    ``ACTIVE`` counts: the lease's session keeper (another thread) may be running its ``SELECT 1``
    inside it at this moment; the next statement waits for the connection's lock."""
    return conn in _held_reads and conn.info.transaction_status in (
        psycopg.pq.TransactionStatus.INTRANS, psycopg.pq.TransactionStatus.ACTIVE)


def end_held_read(conn: psycopg.Connection[dict[str, Any]]) -> None:
    """Roll back the read :func:`begin_with_read` left open on ``conn``, if any (it wrote nothing)."""
    if conn in _held_reads:
        _held_reads.discard(conn)
        roll_back(conn)


@contextmanager
def pipelined(conn: psycopg.Connection[dict[str, Any]], *, begun: bool = False) -> Iterator[Cursor]:
    """A transaction whose statements are sent as one flight with its ``BEGIN`` and ``COMMIT``
    (psycopg pipeline mode): a stage costs one round trip when the caller fetches nothing before
    the end. A fetch inside the block sends what is queued so far (one more round trip, same
    transaction). Refusals therefore come from the database itself (``*_strict`` functions), and
    any error rolls the whole transaction back. The cursor's results stay readable after the block.
    The event observer is told as by :func:`transaction` (its ``prepare`` read, when it needs one,
    is one more round trip). ``begun``: finish the transaction :func:`begin_with_read` opened (no
    ``BEGIN``); otherwise, inside another transaction, this is :func:`transaction`.
    """
    if begun:
        if not holds_read(conn):
            raise psycopg.ProgrammingError("pipelined(begun=True) needs the transaction begin_with_read opened")
        _held_reads.discard(conn)
    else:
        end_held_read(conn)
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            with transaction(conn) as cur:
                yield cur
            return
    cur, control = conn.cursor(), conn.cursor()  # the caller's results stay on ``cur``
    with observe.Watch() as watch:
        try:
            with conn.pipeline():
                # Explicit BEGIN/COMMIT as statements: a fetch mid-way must not commit half a stage
                # (between syncs, the extended protocol would otherwise commit what came before).
                if not begun:
                    control.execute("BEGIN")
                yield cur
                watch.prepare(control)
                control.execute("COMMIT")
        except psycopg.Error as exc:
            roll_back(conn)
            _raise_domain_error(exc)
        except BaseException:
            roll_back(conn)
            raise


def roll_back(conn: psycopg.Connection[dict[str, Any]]) -> None:
    """End whatever transaction is still open on ``conn`` without committing it (a no-op when none
    is, or when the connection is gone: the server rolled it back)."""
    if not conn.closed and not conn.broken and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        conn.execute("ROLLBACK")


#: SQLSTATEs raised by the stage functions (ledger/stage_functions.py), as domain errors.
_STAGE_REFUSALS: dict[str, type[Exception]] = {"PL101": TransitionRefused, "PL102": StaleLease}


def _raise_domain_error(exc: psycopg.Error) -> NoReturn:
    """The role guards (ledger/roles_ddl.py) raise SQLSTATE PL001..PL005, the stage functions
    PL101..PL103; the transaction has rolled back. Anything else stays a driver error (connection
    loss is retried upstream)."""
    state, message = exc.sqlstate or "", (exc.diag.message_primary or str(exc))
    if state == "PL103":
        raise LeaseBusy(message, which="lost") from exc
    if state in _STAGE_REFUSALS:
        raise _STAGE_REFUSALS[state](message) from exc
    if state.startswith("PL"):
        raise PrivilegeRefused(message, sqlstate=state) from exc
    raise exc


# An escaped NUL in JSON text: "\u0000" preceded by an even number of backslashes.
_NUL = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def _dumps(value: Any) -> str:
    # jsonb cannot hold U+0000. Keep it visible as the six characters "\u0000" instead of failing
    # the whole write: a hostile NUL must still leave a record. (Only jsonb copies are rewritten:
    # the signed message itself is sealed as bytes and round-trips exactly.)
    return _NUL.sub(r"\1\\\\u0000", json.dumps(value, default=str))


def _json(value: Any) -> Jsonb:
    return Jsonb(value, dumps=_dumps)


def stored_form(value: Any) -> Any:
    """``value`` as a jsonb column written by this store gives it back (tuples as lists, NULs kept visible)."""
    return json.loads(_dumps(value))


# --- ledger events ------------------------------------------------------------------------------


def append_event_txn(
    cur: Cursor,
    action_id: str,
    event: str,
    actor: str,
    evidence: dict[str, Any] | None = None,
    redact_fields: Redactor | Iterable[str] = (),
) -> None:
    """Append one event to an action's chain (the trigger assigns seq and hashes). Evidence is
    redacted by the policy plus ``redact_fields`` (a redactor, or declared field names)."""
    clean = observe.annotate(as_redactor(redact_fields)(evidence or {}))
    observe.appended(action_id, event, clean)
    cur.execute(
        "INSERT INTO ledger_events (action_id, event, actor, evidence) VALUES (%s, %s, %s, %s)",
        (action_id, event, actor, _json(clean)),
    )


def append_events_txn(cur: Cursor, action_id: str, actor: str, events: list[tuple[str, dict[str, Any]]],
                      redact_fields: Redactor | Iterable[str] = ()) -> None:
    """Append several events in order with one statement per event (same transaction)."""
    clean = as_redactor(redact_fields)
    rows = [(action_id, name, actor, observe.annotate(clean(ev))) for name, ev in events]
    for row in rows:
        observe.appended(action_id, row[1], row[3])
    cur.executemany("INSERT INTO ledger_events (action_id, event, actor, evidence) VALUES (%s, %s, %s, %s)",
                    [(a, n, who, _json(ev)) for a, n, who, ev in rows])


# --- actions ----------------------------------------------------------------------------------------


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
    #: The signed message, sealed (ledger/seal.py); read it through :attr:`signed_message`.
    sealed_message: bytes | None = field(default=None, repr=False)

    @property
    def signed_message(self) -> dict[str, Any] | None:
        """The controller's original signed message, exactly as signed, when it was recorded.

        ``envelope`` is a redacted copy; this opens the sealed original (the process must have the
        seal key: ``Settings.seal_key_file``). Rows written before sealing existed fall back to
        their stored envelope, which was not redacted then."""
        return signed_message_of({"action_id": self.action_id, "sealed_message": self.sealed_message,
                                  "envelope": self.envelope, "key_id": self.key_id, "signature": self.signature})

    @property
    def signed_envelope(self) -> dict[str, Any]:
        """The envelope as signed (arguments unredacted) when a signed message exists, else the
        stored copy. Code that acts on the arguments (verification, recovery) reads this."""
        message = self.signed_message
        return message["envelope"] if message is not None else self.envelope

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
            cancel_requested_at=row.get("cancel_requested_at"), sealed_message=row.get("sealed_message"),
        )


def signed_message_of(row: dict[str, Any]) -> dict[str, Any] | None:
    """The signed message of an ``actions`` row read as a dict (``action_id``, ``sealed_message``,
    and for rows from before sealing ``envelope``, ``key_id``, ``signature``)."""
    if row.get("sealed_message") is not None:
        return seal.open_message(row["action_id"], row["sealed_message"])
    if not row.get("signature"):
        return None
    return {"envelope": row["envelope"], "key_id": row["key_id"], "signature": row["signature"]}


def insert_action_txn(cur: Cursor, envelope: dict[str, Any], *, message: dict[str, Any] | None = None,
                      seal_key: seal.SealKey | None = None, redactor: Redactor | None = None,
                      task_id: str | None = None, status: ActionStatus = ActionStatus.published,
                      kind: str = "action", parent_action_id: str | None = None) -> bool:
    """Record a newly published action; False when the action id is already known.

    ``envelope`` is stored redacted (``redactor``, default: the policy and the envelope's own
    declarations). The signed ``message``, when given, is stored sealed with ``seal_key`` (its key
    id and signature also in the clear: neither is secret)."""
    sealed = None
    if message is not None:
        if seal_key is None:
            raise ConfigurationError("a signed message is only stored sealed: no seal key given")
        sealed = seal.seal_message(seal_key, envelope["action_id"], message)
    clean = (redactor or for_envelope(envelope))(envelope)
    cur.execute(
        """INSERT INTO actions (action_id, run_id, step, tenant, action_type, server, tool,
                               idempotency_key, status, envelope, deadline, key_id, signature, task_id,
                               kind, parent_action_id, sealed_message)
           VALUES (%(action_id)s, %(run_id)s, %(step)s, %(tenant)s, %(action_type)s, %(server)s,
                   %(tool)s, %(idempotency_key)s, %(status)s, %(envelope)s, %(deadline)s, %(key_id)s,
                   %(signature)s, %(task_id)s, %(kind)s, %(parent)s, %(sealed)s)
           ON CONFLICT (action_id) DO NOTHING RETURNING action_id""",
        {"key_id": (message or {}).get("key_id"), "signature": (message or {}).get("signature"),
         "task_id": task_id, "status": status.value, "kind": kind, "parent": parent_action_id, "sealed": sealed,
            "action_id": envelope["action_id"], "run_id": envelope["run_id"], "step": envelope.get("step", 0),
            "tenant": envelope["tenant"], "action_type": envelope["action_type"],
            "server": envelope["server"]["name"], "tool": envelope["tool"]["name"],
            "idempotency_key": envelope["idempotency_key"], "envelope": _json(clean),
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
    redactor: Redactor = POLICY,
    events: list[tuple[str, dict[str, Any]]] | None = None,
    actor: str | None = None,
    redact_fields: Redactor | Iterable[str] = (),
    deferred: bool = False,
) -> ActionRow | None:
    """Move an action to ``status`` only from one of ``allowed``; raise when no row moved.

    ``result`` and ``recovery_data`` are stored redacted by ``redactor``. ``events`` (appended by
    ``actor``, in order, redacted by ``redactor`` plus ``redact_fields``) go in the same round trip,
    through the database function ``proofline_transition``; the role guards judge the move either way.
    ``deferred`` (inside :func:`pipelined`): nothing is fetched and None is returned; the database
    refuses a move that moved no row (``proofline_transition_strict``), rolling the transaction back.
    """
    batch = _event_batch(events, actor, redactor, redact_fields)
    params = {
        "status": status.value, "outcome": outcome.value if outcome else None, "finding": finding,
        "reason": reason_code, "result": _json(redactor(result)) if result is not None else None,
        "recovery": _json(redactor(recovery_data) if recovery_data else {}), "id": action_id,
        "allowed": [s.value for s in allowed], "kind": recovery_kind.value if recovery_kind is not None else None,
        "actor": actor or "", "events": _json(batch),
    }
    call = "SELECT proofline_transition_strict" if deferred else "SELECT * FROM proofline_transition"
    cur.execute(
        f"""{call}(%(id)s, %(allowed)s::action_status[], %(status)s,
               %(outcome)s::outcome_class, %(finding)s, %(reason)s, %(result)s, %(recovery)s,
               %(kind)s::recovery_kind, %(actor)s, %(events)s)""", params)
    if deferred:
        _note_appended(action_id, batch)
        return None
    row = cur.fetchone()
    if row is None:
        cur.execute("SELECT status FROM actions WHERE action_id = %s", (action_id,))
        current = cur.fetchone()
        raise TransitionRefused(
            f"{action_id}: {current['status'] if current else 'missing'} -> {status.value} not allowed",
            action_id=action_id,
        )
    _note_appended(action_id, batch)
    return ActionRow.from_row(row)


def _event_batch(events: list[tuple[str, dict[str, Any]]] | None, actor: str | None, redactor: Redactor,
                 redact_fields: Redactor | Iterable[str] = ()) -> list[list[Any]]:
    """Events as the transition functions take them: ``[name, evidence]``, redacted and annotated."""
    clean = redactor.merged(as_redactor(redact_fields)) if redact_fields else redactor
    batch = [[name, observe.annotate(clean(ev))] for name, ev in (events or [])]
    if batch and actor is None:
        raise ValueError("events need an actor")
    return batch


def _note_appended(action_id: str, batch: list[list[Any]]) -> None:
    for name, ev in batch:
        observe.appended(action_id, name, ev)


def claim_and_start(conn: psycopg.Connection[dict[str, Any]], *, key: str, action_id: str, tenant: str,
                    argument_hash: str, contract_hash: str, replay_window_seconds: float, lease: dict[str, Any],
                    recovery_data: dict[str, Any], redactor: Redactor, events: list[tuple[str, dict[str, Any]]],
                    actor: str) -> bool:
    """A first delivery's claim stage as one statement and one transaction (``proofline_claim``):
    claim the record; only if it was free, record the lease (``lease``: the arguments of
    ``proofline_take_lease``) and move the action to executing with ``events``. Returns whether it
    claimed; when it did not, nothing was written and the caller dispatches on the record."""
    args = (key, action_id, tenant, argument_hash, contract_hash, replay_window_seconds, lease, recovery_data,
            redactor, events, actor)
    with observe.Watch() as watch:
        if conn in _held_reads and not holds_read(conn):
            end_held_read(conn)  # it failed or ended under us: the claim runs as its own transaction
        if conn in _held_reads:
            # The lock-and-read transaction is still open: the claim and its COMMIT finish it, one flight.
            with pipelined(conn, begun=True) as cur:
                batch = _queue_claim(cur, *args)
        else:
            cur = conn.cursor()  # one statement is its own transaction
            try:
                batch = _queue_claim(cur, *args)
            except psycopg.Error as exc:
                _raise_domain_error(exc)
        row = cur.fetchone()
        claimed = bool(row and row["claimed"])
        if claimed:
            _note_appended(action_id, batch)
        # Committed already: the observer reads what it needs (immutable labels) afterwards.
        watch.prepare(conn.cursor())
    return claimed


def _queue_claim(cur: Cursor, key: str, action_id: str, tenant: str, argument_hash: str, contract_hash: str,
                 replay_window_seconds: float, lease: dict[str, Any], recovery_data: dict[str, Any],
                 redactor: Redactor, events: list[tuple[str, dict[str, Any]]], actor: str) -> list[list[Any]]:
    batch = _event_batch(events, actor, redactor)
    cur.execute(
        """SELECT proofline_claim(%(action)s, %(target)s, %(lock_action)s, %(lock_target)s, %(host)s, %(pid)s,
               %(worker)s, %(token)s, %(ttl)s, %(key)s, %(tenant)s, %(arg)s, %(contract)s, %(window)s,
               %(recovery)s, %(events)s) AS claimed""",
        {**lease, "action": action_id, "key": key, "tenant": tenant, "arg": argument_hash, "contract": contract_hash,
         "window": replay_window_seconds, "recovery": _json(redactor(recovery_data)), "events": _json(batch)})
    return batch


def get_action(cur: Cursor, action_id: str) -> ActionRow | None:
    cur.execute("SELECT * FROM actions WHERE action_id = %s", (action_id,))
    row = cur.fetchone()
    return ActionRow.from_row(row) if row else None


def stored_message_at(cur: Cursor, message: Any) -> datetime | None:
    """When the ledger recorded exactly this signed message (its action id, key id and signature),
    by the database clock; ``None`` when it never did. ``published_at`` is set by the database at
    insert and can never change (roles_ddl), so no caller can date a message back."""
    env = message.get("envelope") if isinstance(message, dict) else None
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in
                                            (env.get("action_id"), message.get("key_id"), message.get("signature"))):
        return None
    cur.execute("SELECT published_at FROM actions WHERE action_id = %s AND key_id = %s AND signature = %s",
                (env["action_id"], message["key_id"], message["signature"]))
    row = cur.fetchone()
    return row["published_at"] if row else None


def events_after(cur: Cursor, action_id: str, after_seq: int, limit: int = 100) -> list[dict[str, Any]]:
    """The action's events appended after ``after_seq``, oldest first (names and times only: no
    evidence leaves the ledger this way). One read of the chain's unique (action_id, seq) index."""
    cur.execute("SELECT seq, at, event FROM ledger_events WHERE action_id = %s AND seq > %s ORDER BY seq LIMIT %s",
                (action_id, after_seq, limit))
    return list(cur.fetchall())


def lock_chain_txn(cur: Cursor, chain: str) -> None:
    """Hold ``chain``'s append lock (the one the ledger_chain trigger takes for each insert) until the
    transaction ends, so that reading the chain and appending to it are one step."""
    cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", ("proofline:ledger:" + chain,))


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
    count_attempt: bool = False, redactor: Redactor = POLICY, deferred: bool = False,
) -> int | None:
    """Guarded update: only the holder of the current fencing token may move the record (its
    ``result`` stored redacted); returns the attempts made. ``deferred`` (inside :func:`pipelined`):
    nothing is fetched, None is returned, and a stale token rolls the transaction back."""
    result = redactor(result) if result is not None else None
    cur.execute(
        """SELECT proofline_idempotency_move(%(key)s, %(token)s, %(allowed)s::idempotency_status[], %(status)s,
                                             %(result)s, %(new_token)s, %(attempt)s, %(strict)s) AS attempts""",
        {
            "status": status.value, "result": _json(result) if result is not None else None,
            "new_token": new_token, "attempt": 1 if count_attempt else 0, "key": key, "token": fencing_token,
            "allowed": [s.value for s in allowed], "strict": deferred,
        },
    )
    if deferred:
        return None
    row = cur.fetchone()
    if row is None or row["attempts"] is None:
        raise StaleLease(f"idempotency record {key} is not held by fencing token {fencing_token}", key=key)
    return int(row["attempts"])


def settle_idempotency_txn(cur: Cursor, key: str, status: IdempotencyStatus, evidence: dict[str, Any],
                           redactor: Redactor = POLICY) -> None:
    """Verification's verdict on a record. The action row's guarded transition (same transaction)
    is what serialises verifiers, so no fencing token is needed here."""
    evidence = redactor(evidence)
    cur.execute(
        """UPDATE idempotency_records SET status = %s, result = COALESCE(result, '{}'::jsonb) || %s,
                  updated_at = clock_timestamp() WHERE key = %s""",
        (status.value, _json(evidence), key),
    )


def cancel_arrived_txn(cur: Cursor, action_id: str) -> bool:
    """Whether a cancellation is recorded now, read under the row lock: one that commits before this
    transaction is seen here, one that comes after it finds the action settled."""
    cur.execute("SELECT cancel_requested_at FROM actions WHERE action_id = %s FOR UPDATE", (action_id,))
    row = cur.fetchone()
    return row is not None and row["cancel_requested_at"] is not None


#: The events a verdict writes when it moves an action out of ``verifying`` (recovery/verify.py,
#: worker/record_call.py, recovery/cancel.py): one after a ledger position means a verdict after it.
VERDICT_EVENTS = ("verification_finished", "final_state", "handed_to_recovery", "escalated_state")


def lock_for_verdict_txn(cur: Cursor, action_id: str, seq: int) -> tuple[bool, bool]:
    """Lock the row for a verification's verdict and read, in the same statement, whether a
    cancellation is recorded now and whether a verdict was recorded after ledger position ``seq``
    (where the verification loaded the row). The second tells it that its reads were overtaken:
    the row may be ``verifying`` again, but for a later attempt than the one it read for."""
    cur.execute("SELECT cancel_requested_at IS NOT NULL AS cancelled, EXISTS (SELECT 1 FROM ledger_events e "
                "WHERE e.action_id = a.action_id AND e.seq > %s AND e.event = ANY(%s)) AS overtaken "
                "FROM actions a WHERE a.action_id = %s FOR UPDATE", (seq, list(VERDICT_EVENTS), action_id))
    row = cur.fetchone()
    return (bool(row["cancelled"]), bool(row["overtaken"])) if row else (False, False)


def get_idempotency_txn(cur: Cursor, key: str) -> IdempotencyRecord | None:
    cur.execute("SELECT *, expires_at < clock_timestamp() AS expired FROM idempotency_records WHERE key = %s", (key,))
    row = cur.fetchone()
    return _idem(row) if row else None


# --- revocations and kill switches -----------------------------------------------------------------


def revoke_identity_txn(cur: Cursor, identity: str, by: str, reason: str) -> None:
    cur.execute(
        "INSERT INTO revoked_identities (identity, revoked_by, reason) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
        (identity, by, POLICY.text(reason)),
    )


def contain_txn(cur: Cursor, action_id: str, by: str, reason: str) -> bool:
    """Engage the tool@tenant kill switch of an action in recovery (containment). The database
    derives the switch from the action row, so this role can contain but never clear or choose a
    scope. Returns whether a new switch was engaged (its ``kill_switch_set`` event is recorded)."""
    cur.execute("SELECT proofline_contain(%s, %s, %s) AS engaged", (action_id, by, reason))
    row = cur.fetchone()
    return bool(row and row["engaged"])
