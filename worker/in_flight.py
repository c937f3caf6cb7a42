"""The messages a worker holds, noted where its supervisor can read them after the worker is gone.

A message comes back *redelivered* whenever the worker that held it ends without acknowledging it,
and the message guard (``worker/deliveries.py``) counts such a redelivery against the message: it
cannot tell a message that ends its process from a process ended under it. For a pool process
killed from outside the worker's main process records the difference (``worker/lost_delivery.py``).
When the main process itself ends (killed from outside, or stopped), every message it held comes
back at once, the ones it had prefetched and never started among them, and nobody is left to say
why.

So the main process notes each message it receives, one small file per message in a folder its
supervisor (``proofline worker``) made for that run (``PROOFLINE_IN_FLIGHT_DIR``), and removes the
file once the message is acknowledged or rejected. When the main process ends by SIGKILL or
SIGTERM with no out-of-memory kill on the node since it started, or by a clean exit (a warm
shutdown hands its prefetched messages back), the supervisor records each message still noted as
excused (the guard's ``max_excused_deliveries`` applies) before it starts the next run. Any other
end (a crash, an error exit, an out-of-memory kill) excuses nothing: the guard counts as before.

A main process never runs a task (the pool does), but it decodes every message; a message that
crashes the consumer is one of the "other ends", and stays counted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ledger import store
from proofline.settings import reveal
from worker import deliveries
from worker.oom_count import killed_from_outside, oom_kills

log = logging.getLogger(__name__)

ENV = "PROOFLINE_IN_FLIGHT_DIR"


def _folder() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def noting() -> bool:
    """Whether this process notes what it holds (it runs under the supervisor, which reads them)."""
    return bool(os.environ.get(ENV))


def _name(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def note(key: str, task: str, action_id: str | None) -> None:
    """Note a message the main process now holds (nothing when not run under the supervisor)."""
    folder = _folder()
    if folder is None:
        return
    try:
        (folder / _name(key)).write_text(json.dumps({"key": key, "task": task, "action_id": action_id}))
    except OSError:
        log.debug("in-flight note not written", exc_info=True)


def done(key: str) -> None:
    """The message was acknowledged or rejected: the broker will not hand it back for this run."""
    folder = _folder()
    if folder is None:
        return
    try:
        (folder / _name(key)).unlink(missing_ok=True)
    except OSError:
        log.debug("in-flight note not removed", exc_info=True)


def held(folder: Path) -> list[dict[str, Any]]:
    """The messages a run left noted (unreadable notes are skipped: they excuse nothing)."""
    out = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else ():
        try:
            item = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(item, dict) and isinstance(item.get("key"), str) and isinstance(item.get("task"), str):
            out.append(item)
    return out


def excuses(code: int, oom_at_start: int | None, oom_now: int | None) -> bool:
    """Whether a main process that ended with ``code`` (a negative signal number for a signal)
    excuses what it held: SIGKILL or SIGTERM with the node's OOM count unmoved and known, or a clean exit."""
    return code == 0 or killed_from_outside(code, oom_at_start, oom_now)


def settle_run(folder: Path, code: int, oom_at_start: int | None, oom_now: int | None,
               excuse: Callable[[str, str, str | None], Any]) -> int:
    """After a run ended: excuse what it held when its end allows it (``excuse(key, task,
    action_id)``), then empty the folder for the next run. Returns how many were excused."""
    excused = 0
    try:
        if excuses(code, oom_at_start, oom_now):
            for item in held(folder):
                try:
                    if excuse(item["key"], item["task"], item.get("action_id")) is not None:
                        excused += 1
                except Exception:  # noqa: BLE001 - not excused: the guard counts it, as before
                    log.warning("a held message's excuse was not recorded", exc_info=True,
                                extra={"event": "delivery_excuse_failed"})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
    return excused


class HeldMessages:
    """The supervisor's side: a folder for each run's notes, and the excuses once a run ended."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.folder = Path(tempfile.mkdtemp(prefix="proofline-in-flight-"))
        self._oom_at_start: int | None = None

    def env(self) -> dict[str, str]:
        """The environment of the next run (read just before it starts)."""
        self._oom_at_start = oom_kills()
        return {ENV: str(self.folder)}

    def ended(self, code: int) -> int:
        """The run ended with ``code``: excuse what it held when that end allows it."""
        conn = None

        def excuse(key: str, task: str, action_id: str | None) -> Any:
            nonlocal conn
            if conn is None:
                conn = store.connect(reveal(self.settings.database_url), application_name="proofline-supervisor",
                                     connect_timeout=10)
            return deliveries.excuse(conn, key, task, action_id, self.settings.max_excused_deliveries)

        try:
            excused = settle_run(self.folder, code, self._oom_at_start, oom_kills(), excuse)
        finally:
            if conn is not None:
                conn.close()
        if excused:
            # The supervisor's own lines go to its standard error, beside "worker exited ...".
            print(f"proofline: {excused} message(s) the worker held when it ended (exit {code}) excused: not "
                  "counted against them (held_deliveries_excused)", file=sys.stderr, flush=True)
        return excused

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
