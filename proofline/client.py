"""The controller SDK: publish actions and wait for their proven outcome.

::

    from proofline import Client

    with Client() as client:
        handle = client.publish("ticket.create", tenant="acme",
                                arguments={"tenant": "acme", "title": "disk full", "owner": "ops"},
                                target={"type": "ticket_queue", "id": "acme-ops"})
        result = handle.wait(timeout=60)
        if result.verified: ...

Publishing starts no MCP server: envelopes are bound to the pinned tool contract hashes
(``proofline contracts pin``); the worker compares them with the live server. ``wait`` listens on
the ledger's settled-action channel (``ledger/settled.py``) and reads the action row itself, so it
never misses a settlement and also works, by polling, where notifications cannot arrive.

A client holds two database connections (publishing, listening) and is not thread-safe: use one
client per thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg

from ledger import store
from ledger.settled import CHANNEL, SETTLED
from ledger.states import ActionStatus, Outcome
from proofline.controller import fresh_ids, prepare, publish_many, publish_message, signed_message
from proofline.envelope import Envelope
from proofline.errors import IdempotencyConflict, WaitTimedOut
from proofline.settings import Settings, get_settings, reveal
from proofline.telemetry import tracing

#: Longest sleep between two reads of the row when no notification comes (the polling fallback).
POLL_SECONDS = 1.0


@dataclass(frozen=True)
class ActionResult:
    """What the ledger says about one action now."""

    action_id: str
    status: ActionStatus
    #: The proven outcome class, once known.
    outcome: Outcome | None
    #: The stable reason code of a refusal, failure or escalation.
    reason_code: str | None
    #: What the verification read showed, when verification ran.
    finding: str | None

    @property
    def settled(self) -> bool:
        """Closed, cancelled, or escalated (an operator's turn): nothing moves without someone."""
        return self.status.value in SETTLED

    @property
    def proposed(self) -> bool:
        """Waiting for an approver (authority mode ``propose``): approve or deny it, or wait again."""
        return self.status == ActionStatus.proposed

    @property
    def verified(self) -> bool:
        return self.outcome == Outcome.completed_verified

    @classmethod
    def of(cls, row: store.ActionRow) -> ActionResult:
        return cls(action_id=row.action_id, status=row.status, outcome=row.outcome,
                   reason_code=row.reason_code, finding=row.finding)


class ActionHandle:
    """One published action: read its state, or wait for it to settle."""

    def __init__(self, client: Client, action_id: str, task_id: str | None = None) -> None:
        self.client = client
        self.action_id = action_id
        self.task_id = task_id

    def __repr__(self) -> str:
        return f"ActionHandle({self.action_id!r})"

    def status(self) -> ActionResult:
        return self.client.status(self.action_id)

    def wait(self, timeout: float) -> ActionResult:
        """Block until the action is settled (or ``proposed``: an approver's turn, see
        ``ActionResult.proposed``) and return its proven outcome; raise ``wait_timed_out``
        after ``timeout`` seconds (the action keeps running; wait again or read ``status()``)."""
        return self.client.wait(self.action_id, timeout)


def celery_app(settings: Settings, name: str) -> Any:
    """A Celery app that only sends: the workers' configuration, this deployment's broker."""
    from celery import Celery

    app = Celery(name)
    app.config_from_object("worker.celery_config")
    app.conf.broker_url = reveal(settings.broker_url)
    return app


class Client:
    """A controller: publishes signed envelopes through the ledger and waits on their outcomes."""

    def __init__(self, settings: Settings | None = None, *, app: Any = None, database_url: str | None = None) -> None:
        self.settings = settings or get_settings()
        self._url = (database_url or reveal(self.settings.controller_database_url)
                     or reveal(self.settings.database_url))
        self._app = app
        # Traced when OTEL_TRACES_EXPORTER names an exporter: each publication is the root of its
        # action's trace (proofline/telemetry/tracing.py); a no-op otherwise, or when already set up.
        tracing.setup("proofline-controller", self.settings.environment, self.settings.release)
        self._conn = store.connect(self._url)
        self._listener: psycopg.Connection | None = None

    # --- publishing ---------------------------------------------------------------------------
    def prepare(self, action_type: str, *, arguments: Mapping[str, Any], target: Mapping[str, Any], tenant: str,
                run_id: str | None = None, action_id: str | None = None, **options: Any) -> Envelope:
        """An unsigned envelope bound to the pinned tool contract (see ``proofline.controller.prepare``
        for the options: requester, approval, deadline, evidence ...)."""
        run_id, action_id = fresh_ids(run_id, action_id)
        return prepare(self.settings, action_type=action_type, arguments=dict(arguments), target=dict(target),
                       tenant=tenant, run_id=run_id, action_id=action_id, **options)

    def publish(self, action_type: str | Envelope, **fields: Any) -> ActionHandle:
        """Sign, record and send one action; returns its handle. Takes ``prepare``'s fields, or an
        envelope prepared already. Raises the refusal when the worker would refuse the envelope."""
        envelope = action_type if isinstance(action_type, Envelope) else self.prepare(action_type, **fields)
        published = publish_message(self._conn, self._dispatch(), signed_message(self.settings, envelope),
                                    envelope, settings=self.settings)
        return ActionHandle(self, envelope.action_id, published["task_id"])

    def publish_many(self, actions: Iterable[Mapping[str, Any] | Envelope]) -> list[ActionHandle]:
        """Publish a batch in one ledger transaction (one commit), then send every message.

        Each item is an envelope or a mapping of ``publish``'s fields (``action_type`` included).
        An action id already published with other arguments raises ``idempotency_conflict`` from its
        handle's ``wait``; the rest of the batch is published."""
        envelopes = [a if isinstance(a, Envelope) else self.prepare(**a) for a in actions]
        outcomes = publish_many(self.settings, self._conn, self._dispatch(), envelopes)
        return [ConflictHandle(self, e.action_id, o) if isinstance(o, IdempotencyConflict)
                else ActionHandle(self, e.action_id, o["task_id"]) for e, o in zip(envelopes, outcomes, strict=True)]

    def handle(self, action_id: str) -> ActionHandle:
        """A handle on an action published earlier (by this process or another)."""
        return ActionHandle(self, action_id)

    def _dispatch(self) -> Any:
        from worker.dispatch import CeleryDispatch

        if self._app is None:
            self._app = celery_app(self.settings, "proofline-controller")
        return CeleryDispatch(self._app, self.settings.tenant_shards)

    # --- outcomes -----------------------------------------------------------------------------
    def status(self, action_id: str) -> ActionResult:
        with self._conn.cursor() as cur:
            row = store.get_action(cur, action_id)
        if row is None:
            raise KeyError(f"no action {action_id}")
        return ActionResult.of(row)

    def row(self, action_id: str) -> store.ActionRow:
        """The action's ledger row (its times included); ``KeyError`` when there is none."""
        with self._conn.cursor() as cur:
            row = store.get_action(cur, action_id)
        if row is None:
            raise KeyError(f"no action {action_id}")
        return row

    def events(self, action_id: str, after_seq: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """The names of the action's ledger events after ``after_seq`` (``seq``, ``at``, ``event``),
        oldest first: what a caller following an action's stages reads."""
        with self._conn.cursor() as cur:
            return store.events_after(cur, action_id, after_seq, limit)

    def wait(self, action_id: str, timeout: float) -> ActionResult:
        deadline = time.monotonic() + timeout
        listening = self._listen()  # before the first read: a settlement after it is heard or read
        while True:
            result = self.status(action_id)
            if result.settled or result.proposed:
                return result
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimedOut(f"{action_id} is still {result.status.value} after {timeout:g} s",
                                   action_id=action_id, status=result.status.value)
            pause = min(remaining, POLL_SECONDS)
            if listening:
                listening = self._heard(action_id, pause)
            else:
                time.sleep(pause)
                listening = self._listen()

    def _listen(self) -> bool:
        """Make sure the listening connection is up; False when it cannot be (then we poll)."""
        if self._listener is not None and not self._listener.closed:
            return True
        try:
            self._listener = psycopg.connect(self._url, autocommit=True)
            self._listener.execute(f"LISTEN {CHANNEL}")
            return True
        except psycopg.Error:
            self._listener = None
            return False

    def _heard(self, action_id: str, seconds: float) -> bool:
        """Wait up to ``seconds`` for the settlement notice of ``action_id``; False when the
        listening connection broke (the caller polls and reconnects)."""
        assert self._listener is not None
        try:
            for notice in self._listener.notifies(timeout=seconds):
                if notice.payload == action_id:
                    break
            return True
        except psycopg.Error:
            self._listener.close()
            self._listener = None
            return False

    def close(self) -> None:
        self._conn.close()
        if self._listener is not None:
            self._listener.close()
        tracing.flush()  # the spans of this client's publications are exported, not left queued

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ConflictHandle(ActionHandle):
    """A batch item refused because its action id was already published with other arguments."""

    def __init__(self, client: Client, action_id: str, conflict: IdempotencyConflict) -> None:
        super().__init__(client, action_id)
        self.conflict = conflict

    def wait(self, timeout: float) -> ActionResult:
        raise self.conflict
