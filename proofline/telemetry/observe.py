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


def begin() -> tuple[list[Appended], Any]:
    """Start collecting for an outermost transaction; nested ones share the outer list."""
    outer = _pending.get()
    if outer is not None or _observer is None:
        return (outer if outer is not None else []), None
    mine: list[Appended] = []
    return mine, _pending.set(mine)


def end(token: Any) -> None:
    """Stop collecting (the outermost transaction is over, committed or not)."""
    _pending.reset(token)


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
