"""pytest's rewritten test modules, written once before the xdist workers start.

pytest rewrites the ``assert`` statements of every test module and conftest it imports, and keeps
the result in ``__pycache__`` unless writing bytecode is off (``PYTHONDONTWRITEBYTECODE``, set on
this machine and on some CI hosts). Then each xdist worker rewrites all of them again while it
collects: about 4.5 of a worker's 7 CPU-seconds of collection, paid by six workers at once before
the first test runs. The controller (which collects nothing itself) writes the cache first, with
pytest's own rewriter, so the workers read it; a file whose cache is already current is only
hashed. This uses pytest's internal rewriting functions: if they are not there (another pytest),
nothing is written and the workers rewrite as before. It changes no test's code, only where it is
rewritten.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest


def _test_files(root: Path, patterns: list[str]) -> list[Path]:
    return sorted(p for p in root.rglob("*.py")
                  if "__pycache__" not in p.parts
                  and (p.name == "conftest.py" or any(fnmatch.fnmatch(p.name, pat) for pat in patterns)))


def warm(config: pytest.Config, root: Path) -> int:
    """Write the rewritten code of every test module and conftest under ``root`` whose cache is
    missing or stale; returns how many were written."""
    try:
        from _pytest.assertion import rewrite
        state = config.stash[rewrite.assertstate_key]
        read_pyc, rewrite_test, write_pyc = rewrite._read_pyc, rewrite._rewrite_test, rewrite._write_pyc
        cache_dir, tail = rewrite.get_cache_dir, rewrite.PYC_TAIL
    except (ImportError, AttributeError, KeyError):
        return 0
    written = 0
    for path in _test_files(root, list(config.getini("python_files"))):
        pyc = cache_dir(path) / (path.name[:-3] + tail)
        if read_pyc(path, pyc) is not None:
            continue
        try:
            pyc.parent.mkdir(exist_ok=True)
            source_hash, code = rewrite_test(path, config)
        except (OSError, SyntaxError):
            continue  # the worker's own import reports it
        written += write_pyc(state, code, source_hash, pyc)
    return written
