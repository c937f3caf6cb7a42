"""Who hears about ledger events once they are committed (metrics, traces): an observer sees the
events a transaction appended, in order, and only if that transaction committed.

The store records every append in the current transaction's list (:func:`appended`); the one
installed observer may read more in the same transaction (``prepare``, before commit) and acts
after commit (``committed``). Nothing is observed when no observer is installed.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Appended:
    """One event appended in the current transaction (evidence as stored, redacted)."""

    action_id: str
    event: str
    evidence: dict[str, Any]


class EventObserver(Protocol):
    def prepare(self, cur: Any, events: list[Appended]) -> Any:
        """Inside the transaction, after the caller's statements: gather what ``committed`` needs."""

    def committed(self, prepared: Any) -> None:
        """After the commit; must not raise."""


_observer: EventObserver | None = None
_pending: ContextVar[list[Appended] | None] = ContextVar("proofline_ledger_appended", default=None)


def install(observer: EventObserver | None) -> None:
    """Install the process's observer (None removes it)."""
    global _observer
    _observer = observer


def observer() -> EventObserver | None:
    return _observer


def appended(action_id: str, event: str, evidence: Any) -> None:
    """Note an append (no-op outside an observed transaction)."""
    pending = _pending.get()
    if pending is not None:
        pending.append(Appended(action_id, event, evidence if isinstance(evidence, dict) else {}))


class Watch:
    """One transaction's appended events, told to the observer if (and once) it commits.

    Used as a context manager around the transaction: an outermost one collects its own list, a
    nested one adds to the outer list (and takes its additions back if it fails: a rolled-back
    savepoint appended nothing). :meth:`prepare` runs the observer's read inside the transaction;
    leaving the block without an exception calls ``committed``, after collecting has stopped."""

    def __init__(self) -> None:
        outer = _pending.get()
        if outer is not None or _observer is None:
            self.events: list[Appended] = outer if outer is not None else []
            self._token: Any = None
        else:
            self.events = []
            self._token = _pending.set(self.events)
        self._observer = _observer if self._token is not None else None
        self._mark = len(self.events)
        self._prepared: Any = None

    def prepare(self, cur: Any) -> None:
        if self._observer is not None and self.events:
            self._prepared = self._observer.prepare(cur, list(self.events))

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            del self.events[self._mark:]
            self._prepared = None
        if self._token is not None:
            _pending.reset(self._token)
        if self._observer is not None and self._prepared is not None:
            self._observer.committed(self._prepared)


_annotator: Any = None


def install_annotator(annotator: Any) -> None:
    """A callable returning fields every appended event's evidence gets (the trace id), or None."""
    global _annotator
    _annotator = annotator


def annotate(evidence: dict[str, Any]) -> dict[str, Any]:
    """``evidence`` with the annotator's fields added (the same object when there are none)."""
    if _annotator is None:
        return evidence
    extra = _annotator()
    return {**evidence, **extra} if extra else evidence
