"""Plans: what the system of record says a write would change, hashed so an approval can name it.

Before a write is approved the runtime asks the real system for a plan through the read identity
(``worker/plan.py``); the approver sees its content and approves its hash. Right before the call the
worker prepares again: a different hash, or a different target version, is ``plan_changed`` and the
call never starts. A contract without a prepare tool gets a plan made of its precondition snapshot
and the arguments.

Everything here is pure: the hash, the comparison and the diff a console shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from proofline.canonical import sha256_hex
from proofline.errors import PlanChanged

#: How many differing paths a diff (and ``plan_changed`` evidence) names at most.
MAX_DIFF_PATHS = 50


class PlanSource(str, Enum):
    """Where a plan came from."""

    #: The contract's prepare tool answered with a plan.
    prepare_tool = "prepare_tool"
    #: No prepare tool: the precondition read's snapshot plus the arguments.
    precondition_snapshot = "precondition_snapshot"


@dataclass(frozen=True)
class Plan:
    """One prepared plan. ``hash`` covers the source, the content, the target version and the
    arguments hash; ``plan_id`` is the downstream's label for it and is not hashed (a server may
    name the same change differently each time it is asked)."""

    source: PlanSource
    plan_id: str | None
    #: The JSON the approver sees.
    content: dict[str, Any]
    #: The version of the target the plan was computed against, when the contract can say.
    target_version: Any
    arguments_hash: str
    hash: str

    def as_evidence(self) -> dict[str, Any]:
        """What the ledger and a console keep of a plan."""
        return {"source": self.source.value, "plan_id": self.plan_id, "plan_hash": self.hash,
                "target_version": self.target_version, "content": self.content}


def plan_hash(source: PlanSource, content: dict[str, Any], target_version: Any, arguments_hash: str) -> str:
    """sha256 of the canonical JSON (RFC 8785) of the four hashed parts."""
    return sha256_hex({"source": source.value, "content": content, "target_version": target_version,
                       "arguments_hash": arguments_hash})


def new_plan(source: PlanSource, content: dict[str, Any], *, arguments_hash: str, plan_id: str | None = None,
             target_version: Any = None) -> Plan:
    """A plan with its hash computed here (never taken from the server)."""
    return Plan(source=source, plan_id=plan_id, content=content, target_version=target_version,
                arguments_hash=arguments_hash, hash=plan_hash(source, content, target_version, arguments_hash))


def check_plan(approved_hash: str, approved_target_version: Any, fresh: Plan) -> None:
    """Refuse with ``plan_changed`` unless ``fresh`` is the plan that was approved.

    The evidence names what differs: ``changed`` lists ``hash`` and/or ``target_version``, with both
    values of each."""
    changed = []
    if fresh.hash != approved_hash:
        changed.append("hash")
    if fresh.target_version != approved_target_version:
        changed.append("target_version")
    if changed:
        raise PlanChanged(
            f"the plan differs from the approved one ({', '.join(changed)})",
            changed=",".join(changed), approved_hash=approved_hash, fresh_hash=fresh.hash,
            approved_target_version=approved_target_version, fresh_target_version=fresh.target_version,
            plan_id=fresh.plan_id, source=fresh.source.value)


def plan_diff(old: Any, new: Any, limit: int = MAX_DIFF_PATHS) -> list[dict[str, Any]]:
    """Where two plan contents differ: ``[{"path", "old", "new"}]`` in document order, a path being
    dotted keys and list indexes (``changes.0.after``). A key present on one side only has the other
    side ``None`` and ``"missing": "old"`` or ``"new"``. At most ``limit`` entries."""
    found: list[dict[str, Any]] = []
    _diff(old, new, "", found, limit)
    return found


_ABSENT = object()


def _diff(old: Any, new: Any, path: str, found: list[dict[str, Any]], limit: int) -> None:
    if len(found) >= limit:
        return
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*old, *(k for k in new if k not in old)]:
            _diff(old.get(key, _ABSENT), new.get(key, _ABSENT), f"{path}.{key}" if path else str(key), found, limit)
        return
    if isinstance(old, list) and isinstance(new, list):
        for i in range(max(len(old), len(new))):
            _diff(old[i] if i < len(old) else _ABSENT, new[i] if i < len(new) else _ABSENT,
                  f"{path}.{i}" if path else str(i), found, limit)
        return
    if old is _ABSENT or new is _ABSENT:
        found.append({"path": path, "old": None if old is _ABSENT else old, "new": None if new is _ABSENT else new,
                      "missing": "old" if old is _ABSENT else "new"})
    elif old != new or type(old) is not type(new):
        # 1 and True are equal in Python but not in JSON: a type change is a change.
        found.append({"path": path, "old": old, "new": new})
