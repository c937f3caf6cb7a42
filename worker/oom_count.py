"""The node's out-of-memory kill count, which tells a kill from outside from the kernel's own.

The kernel's out-of-memory killer ends a process with SIGKILL, as an operator's ``kill -9`` does;
``oom_kill`` in ``/proc/vmstat`` counts the former (cgroup kills included). A process that ended by
SIGKILL or SIGTERM while the count stayed put was killed by someone else.
"""

from __future__ import annotations

import signal
from typing import Any

VMSTAT = "/proc/vmstat"
#: Exit statuses (negative signal numbers, as multiprocessing and subprocess report them) of an outside kill.
OUTSIDE_KILLS = frozenset({-signal.SIGKILL, -signal.SIGTERM})


def oom_kills(path: str = VMSTAT) -> int | None:
    """The kernel's count of out-of-memory kills since boot; None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def killed_from_outside(exitcode: Any, oom_before: int | None, oom_after: int | None) -> bool:
    """Whether a process that ended with ``exitcode`` was killed by someone else: SIGKILL or
    SIGTERM, and no out-of-memory kill on the node between the two readings (both known)."""
    if not isinstance(exitcode, int) or exitcode not in OUTSIDE_KILLS:
        return False
    return oom_before is not None and oom_after is not None and oom_after == oom_before
