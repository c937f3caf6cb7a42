"""Can this host start a sandbox? bwrap found on this process's PATH and run once, confined the way
a server's launch confines it (new user, PID, IPC, UTS and network namespaces).

A bwrap that is installed but cannot create namespaces (a container without user namespaces, a
setuid bit removed, a wrapper script that fails) is as unusable as none: every sandboxed call
would fail at launch. ``proofline doctor`` and ``proofline worker`` (proofline/setup_checks.py) ask
here, and the launcher runs the same binary (:func:`worker.sandbox.bwrap_binary`).
"""

from __future__ import annotations

import shutil
import subprocess

from worker.sandbox import BWRAP, launcher_environment

#: A probe that has not finished after this many seconds has failed (a hung bwrap would hang every call).
PROBE_TIMEOUT_SECONDS = 10
#: The namespaces of every launch (worker/sandbox.py ``bwrap_args``), and a read-only view of the host.
PROBE_ARGS = ("--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net",
              "--die-with-parent", "--ro-bind", "/", "/", "--", "/bin/true")


def bwrap_problem() -> str | None:
    """Why no sandbox can start here, in words for a one-line refusal; None when bwrap runs."""
    found = shutil.which(BWRAP)
    if found is None:
        return "bubblewrap (bwrap) is not on PATH"
    try:
        done = subprocess.run([found, *PROBE_ARGS], env=launcher_environment(), capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        return f"{found} did not finish a test sandbox within {PROBE_TIMEOUT_SECONDS} s"
    except OSError as exc:
        return f"{found} cannot be run: {exc.strerror or exc}"
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout or "").split())[:200] or "no message"
        return f"{found} cannot start a sandbox here (exit {done.returncode}: {said})"
    return None
