"""What a disabled fault point costs: ``python -m ops.faultpoint_bench [--n 1000000]``.

``worker/faultpoints.py`` puts test-only kill points on the execute path (before the request is
sent, after it returns, after the ledger write). Disabled (every production worker) a point must
cost nothing that matters. This measures, in one run and one process, the cost per call of

- an empty function call (the baseline: the least a point could cost; each row is called through
  the same lambda),
- ``faultpoints.hit()`` with fault points disabled (production),
- ``faultpoints.hit()`` enabled with no armed-points file (a test worker between tests),

and prints each per call and as a ratio of the baseline, next to the cost of one SHA-256 of a
1 KiB envelope (a cost the execute path already pays several times per action) for scale.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from collections.abc import Callable


def _per_call(fn: Callable[[], object], n: int) -> float:
    best = float("inf")
    for _ in range(5):  # best of five: the least disturbed run
        started = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - started) / n)
    return best


def _empty() -> None:
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    n = parser.parse_args(argv).n
    from proofline.settings import get_settings
    from worker import faultpoints

    envelope = os.urandom(1024)
    # Called through a lambda, as the points below are: the baseline pays the same wrapping.
    rows: list[tuple[str, float]] = [("empty function call (baseline)", _per_call(lambda: _empty(), n))]
    os.environ.pop("PROOFLINE_FAULT_POINTS_ENABLED", None)
    get_settings.cache_clear()
    rows.append(("hit(), fault points disabled", _per_call(lambda: faultpoints.hit("before_send"), n)))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update({"PROOFLINE_FAULT_POINTS_ENABLED": "true", "PROOFLINE_ENVIRONMENT": "test",
                           "PROOFLINE_FAULT_POINTS_FILE": os.path.join(tmp, "absent.json")})
        get_settings.cache_clear()
        rows.append(("hit(), enabled, nothing armed", _per_call(lambda: faultpoints.hit("before_send"), n // 10)))
    for key in ("PROOFLINE_FAULT_POINTS_ENABLED", "PROOFLINE_ENVIRONMENT", "PROOFLINE_FAULT_POINTS_FILE"):
        os.environ.pop(key, None)
    get_settings.cache_clear()
    rows.append(("sha256 of a 1 KiB envelope (for scale)", _per_call(lambda: hashlib.sha256(envelope).digest(), n)))
    base = rows[0][1]
    for name, cost in rows:
        print(f"{name:<42} {cost * 1e9:9.1f} ns/call  {cost / base:7.2f}x baseline")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
