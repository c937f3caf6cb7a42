"""Test-only fault points: places inside the worker where a test can make the process die.

They exist to prove crash safety at exact stages (before the request is sent, after the response
arrived but before the ledger write, after the ledger write but before the broker ack). They are
off unless two environment variables are set together, and ``PROOFLINE_ENVIRONMENT=production``
refuses them outright, so no production configuration can turn them on by accident:

    PROOFLINE_FAULT_POINTS_ENABLE=yes-kill-my-workers
    PROOFLINE_FAULT_POINTS=/path/to/points.json   # {"after_send": {"remaining": 1, "action": "kill"}}

The file is read at every point and its counters are decremented under a file lock, so a point
fires a bounded number of times across all worker processes.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from pathlib import Path

ENABLE_VALUE = "yes-kill-my-workers"
POINTS = ("on_delivery", "before_send", "after_send", "after_ledger", "before_verify_commit")


def _path() -> Path | None:
    if os.environ.get("PROOFLINE_FAULT_POINTS_ENABLE") != ENABLE_VALUE:
        return None
    if os.environ.get("PROOFLINE_ENVIRONMENT", "").lower() == "production":
        return None
    value = os.environ.get("PROOFLINE_FAULT_POINTS")
    return Path(value) if value else None


def hit(point: str) -> None:
    """Maybe act at ``point``: ``kill`` (SIGKILL this process) or ``stop`` (freeze for a while)."""
    path = _path()
    if path is None or not path.exists():
        return
    with path.open("r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            points = json.loads(handle.read() or "{}")
        except ValueError:
            return
        spec = points.get(point)
        if not spec or spec.get("remaining", 0) == 0:
            return
        if spec["remaining"] > 0:
            spec["remaining"] -= 1
        spec["fired"] = spec.get("fired", 0) + 1
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(points))
        handle.flush()
        os.fsync(handle.fileno())
    if spec.get("action", "kill") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        time.sleep(float(spec.get("seconds", 10)))


def arm(path: Path, point: str, remaining: int = 1, action: str = "kill", seconds: float = 0.0) -> None:
    """Test helper: arm one point (other points in the file are kept)."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}")
    points = json.loads(path.read_text() or "{}") if path.exists() else {}
    fired_so_far = points.get(point, {}).get("fired", 0)
    points[point] = {"remaining": remaining, "action": action, "seconds": seconds, "fired": fired_so_far}
    path.write_text(json.dumps(points))


def fired(path: Path, point: str) -> int:
    points = json.loads(path.read_text() or "{}") if path.exists() else {}
    return int(points.get(point, {}).get("fired", 0))
