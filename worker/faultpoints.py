"""Test-only fault points: places inside the worker where a test can make the process die.

They exist to prove crash safety at exact stages (before the request is sent, after the response
arrived but before the ledger write, after the ledger write but before the broker ack). They are
read through the settings object only, off unless both are set, and ``Settings`` refuses to load
(a validation error) when they are enabled in any environment but development or test, so no
production configuration can turn them on by accident:

    PROOFLINE_FAULT_POINTS_ENABLED=true
    PROOFLINE_FAULT_POINTS_FILE=/path/to/points.json   # {"after_send": {"remaining": 1, "action": "kill"}}

Actions: ``kill`` (SIGKILL: an outside kill), ``crash`` (SIGSEGV: a native crash), ``stop``
(sleep ``seconds``: a frozen process), ``raise`` (an unforeseen exception, as a defect would
raise: the task's error path, logs and Sentry run) and
``hold`` (wait at the point until the test calls :func:`release`, at most ``seconds``: a slow
stage whose length the test decides by a condition, not by a sleep; heartbeats keep running).

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

from proofline.settings import get_settings

POINTS = ("on_delivery", "before_send", "after_task_created", "after_send", "after_ledger", "before_verify_commit",
          "during_sweep",
          "before_count", "before_dead_letter_record",
          "before_dead_letter_move")
ACTIONS = ("kill", "crash", "stop", "raise", "hold")
#: How often a held point looks at the file for its release.
HOLD_POLL_SECONDS = 0.02


class FaultPointRaised(RuntimeError):
    """Raised by a fault point armed with ``raise``: stands in for an unforeseen defect."""


def hit(point: str, action_id: str | None = None) -> None:
    """Maybe act at ``point``: ``kill`` (SIGKILL this process), ``stop`` (freeze for a while) or
    ``raise`` (:class:`FaultPointRaised`). A point armed for one action fires only where the
    caller names that action, so work left over from elsewhere cannot take its shot. Disabled, it
    is one cached lookup and one attribute test (``python -m ops.faultpoint_bench`` measures it)."""
    settings = get_settings()
    if not settings.fault_points_enabled or settings.fault_points_file is None:
        return
    path = Path(settings.fault_points_file)
    if not path.exists():
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
        if spec.get("action_id") and spec["action_id"] != action_id:
            return
        if spec["remaining"] > 0:
            spec["remaining"] -= 1
        spec["fired"] = spec.get("fired", 0) + 1
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(points))
        handle.flush()
        os.fsync(handle.fileno())
    action = spec.get("action", "kill")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "crash":  # what a native crash leaves: an end by SIGSEGV, never an outside kill
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGSEGV)
    elif action == "raise":
        raise FaultPointRaised(f"fault point {point} raised")
    elif action == "hold":
        _hold(path, point, spec["fired"], float(spec.get("seconds") or 30))
    else:
        time.sleep(float(spec.get("seconds", 10)))


def _released(path: Path, point: str, shot: int) -> bool:
    try:
        points = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return True  # the file is gone or unreadable: nobody can release us, so do not wait
    return int(points.get(point, {}).get("released", 0)) >= shot


def _hold(path: Path, point: str, shot: int, bound: float) -> None:
    """Wait until the ``shot``-th firing of ``point`` is released, or ``bound`` seconds passed."""
    deadline = time.monotonic() + bound
    while not _released(path, point, shot) and time.monotonic() < deadline:
        time.sleep(HOLD_POLL_SECONDS)


def arm(path: Path, point: str, remaining: int = 1, action: str = "kill", seconds: float = 0.0,
        action_id: str | None = None) -> None:
    """Test helper: arm one point (other points in the file are kept), for every action or one."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}")
    if action not in ACTIONS:
        raise ValueError(f"unknown fault point action {action!r}")
    # Under the lock hit() takes: a worker firing meanwhile must not write back the old counters
    # (a disarm lost that way leaves a point firing on).
    with path.open("a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        points = json.loads(handle.read() or "{}")
        fired_so_far = points.get(point, {}).get("fired", 0)
        # Earlier shots count as released: only the shots of this arming wait for release().
        points[point] = {"remaining": remaining, "action": action, "seconds": seconds, "fired": fired_so_far,
                         "released": fired_so_far, "action_id": action_id}
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(points))


def release(path: Path, point: str) -> None:
    """Test helper: let every process held at ``point`` go on (and disarm it)."""
    if not path.exists():
        return
    with path.open("r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        points = json.loads(handle.read() or "{}")
        spec = points.get(point)
        if not spec:
            return
        spec["remaining"] = 0
        spec["released"] = spec.get("fired", 0)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(points))


def fired(path: Path, point: str) -> int:
    points = json.loads(path.read_text() or "{}") if path.exists() else {}
    return int(points.get(point, {}).get("fired", 0))
