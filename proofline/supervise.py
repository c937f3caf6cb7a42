"""A small supervisor for worker processes: restart on an unexpected exit, forward stop signals.

Celery's worker can die on a broker crash (kombu raises ``AttributeError: 'NoneType' object has
no attribute 'hostname'`` while restoring unacknowledged messages from a Redis that is gone: a
long-standing family of upstream issues). In production a process manager restarts it
(``restart: unless-stopped`` in docker-compose, ``Restart=always`` in systemd); ``proofline worker``
does the same when run bare, so nothing depends on a broker never crashing.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

log = logging.getLogger(__name__)


def supervise(argv: list[str], *, max_restarts: int = 100, backoff_seconds: float = 1.0) -> int:
    """Run ``argv`` until it exits cleanly or is told to stop; restart it otherwise (bounded)."""
    stopping = False
    child: subprocess.Popen | None = None

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    restarts = 0
    while True:
        child = subprocess.Popen(argv)
        code = child.wait()
        if stopping or code == 0:
            return code
        restarts += 1
        if restarts > max_restarts:
            print(f"proofline: worker exited {code}; giving up after {max_restarts} restarts", file=sys.stderr)
            return code
        print(f"proofline: worker exited {code}; restarting ({restarts}/{max_restarts})", file=sys.stderr,
              flush=True)
        time.sleep(min(backoff_seconds * restarts, 10.0))
