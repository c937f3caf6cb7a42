"""A watchdog around the CEL expressions whose cost the static limits cannot bound.

Without comprehensions an admitted expression costs at most a few hundred milliseconds on any
input the runtime accepts (measured: 31 concatenations of a 250 KiB string, 0.26 s). With one, the
body runs once per list item, and a body that builds large strings can burn tens of seconds
(measured: 35 s for 1,000 items) while staying inside every static limit. So expressions with a
comprehension are evaluated in a helper process, one per calling process, started on first use
and reused: it has a time budget (killed and replaced past it), an address-space limit, and a
crash there (a native stack overflow, a panic) is a recorded :class:`ConditionError` here, never a
dead worker. One round trip costs about 2x an in-process evaluation (``python -m ops.cel_bench``).

Values cross the pipe as JSON: the variables are JSON documents already (envelope, extracted
results, reads); a comprehension's result that JSON cannot carry comes back as its text.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
from typing import Any

from proofline.errors import ConditionError

#: Wall-clock budget of one evaluation in the helper.
BUDGET_SECONDS = 2.0
#: Address-space limit of the helper process.
MEMORY_BYTES = 1024 * 1024 * 1024
#: How long a new helper may take to start (an interpreter and the CEL library: seconds on a loaded
#: host). Its start is not part of any evaluation's budget: the budget bounds the evaluation only.
STARTUP_SECONDS = 60.0
#: The line a helper writes once it can evaluate.
READY = b'{"ready": true}\n'


class _Helper:
    def __init__(self) -> None:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        self.pid = os.getpid()  # the process that owns this helper
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proofline.cel_watchdog", str(MEMORY_BYTES)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True)
        self.started = False

    def ask(self, source: str, variables: dict[str, Any], budget: float) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if not self.started:
            try:
                if self._line(STARTUP_SECONDS) != READY:
                    raise _HelperGone("the evaluator process did not announce itself")
            except _OverBudget:
                raise _HelperGone(f"the evaluator process did not start within {STARTUP_SECONDS:.0f}s") from None
            self.started = True
        line = json.dumps([source, variables], default=str).encode() + b"\n"
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise _HelperGone(f"the evaluator process is gone: {exc!r}") from None
        reply = json.loads(self._line(budget))
        if "error" in reply:
            raise ConditionError(f"cannot evaluate {source[:200]!r}: {reply['error'][:300]}")
        return reply["value"]

    def _line(self, budget: float) -> bytes:
        """The helper's next line, within ``budget`` seconds."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + budget
        chunks: list[bytes] = []
        fd = self.proc.stdout.fileno()
        while True:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(0.0, remaining))
            if not ready:
                raise _OverBudget(f"evaluation took longer than {budget:.1f}s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise _HelperGone(f"the evaluator process died (exit {self.proc.poll()})")
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                return b"".join(chunks)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class _OverBudget(Exception):
    pass


class _HelperGone(Exception):
    pass


_helper: _Helper | None = None
_lock = threading.Lock()


def evaluate_guarded(source: str, variables: dict[str, Any], budget: float = BUDGET_SECONDS) -> Any:
    """Evaluate in the helper process; past the budget or on its death, a ConditionError."""
    global _helper
    with _lock:
        if _helper is None or _helper.pid != os.getpid() or _helper.proc.poll() is not None:
            _helper = _Helper()  # a forked child never shares its parent's helper
        helper = _helper
        try:
            return helper.ask(source, variables, budget)
        except (_OverBudget, _HelperGone) as exc:
            helper.kill()
            _helper = None
            raise ConditionError(f"cannot evaluate {source[:200]!r}: {exc}", watchdog=type(exc).__name__) from None


@atexit.register
def _stop() -> None:
    if _helper is not None and _helper.pid == os.getpid():
        _helper.kill()


def serve(memory_bytes: int) -> None:
    """The helper's loop: one JSON line in, one JSON line out, until stdin closes."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    from proofline.conditions import evaluate_here

    sys.stdout.buffer.write(READY)  # imported: what follows is evaluation only
    sys.stdout.flush()
    for line in sys.stdin.buffer:
        try:
            source, variables = json.loads(line)
            reply = {"value": evaluate_here(source, variables)}
        except BaseException as exc:  # noqa: BLE001 - a panic or MemoryError is this evaluation's answer
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            reply = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        try:
            out = json.dumps(reply)
        except (TypeError, ValueError):
            out = json.dumps({"value": str(reply.get("value"))})
        sys.stdout.write(out + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else MEMORY_BYTES)
