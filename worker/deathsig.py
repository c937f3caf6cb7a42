"""``python -I -S deathsig.py PARENT_PID COMMAND...``: run COMMAND so that it dies with its parent.

An audited sandbox's tracer (strace) is started by a worker's pool process. Should that process be
killed (an OOM kill, a pool restart), nothing else would end the tracer: it would be re-parented to
PID 1 and, if it was still opening its output FIFO, wait there for ever. This wrapper asks the kernel
for SIGKILL on the parent's death (``prctl(PR_SET_PDEATHSIG)``, which survives ``exec``), checks that
the parent did not die before the request took hold, and execs COMMAND in its place (same pid).

It runs as its own script, with no imports beyond the standard library (``-I -S``: no site, no
user paths), from the launcher environment; it is not part of the sandbox.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    parent = int(argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        sys.stderr.write(f"deathsig: prctl failed: {os.strerror(ctypes.get_errno())}\n")
        os._exit(126)
    if os.getppid() != parent:
        os._exit(125)  # the parent died between fork and prctl: nobody is left to read the audit
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv)
