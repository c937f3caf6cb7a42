"""The suite's own machinery: the controller's rewrite cache and the session pool's idle reaping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _pytest.assertion import rewrite

import tests.conftest as suite
from tests.rewrite_cache import warm


def test_the_rewrite_cache_is_what_pytest_reads_and_is_written_once(tmp_path: Path,
                                                                     pytestconfig: pytest.Config) -> None:
    module = tmp_path / "test_sample.py"
    module.write_text("def test_sum():\n    assert 1 + 1 == 2\n")
    (tmp_path / "helper.py").write_text("X = 1\n")  # not a test module: pytest does not rewrite it
    assert warm(pytestconfig, tmp_path) == 1
    pyc = tmp_path / "__pycache__" / ("test_sample" + rewrite.PYC_TAIL)
    code = rewrite._read_pyc(module, pyc)
    assert code is not None
    # Rewritten: the module imports pytest's assertion helpers, which a plain compile does not.
    assert "@pytest_ar" in code.co_names
    assert warm(pytestconfig, tmp_path) == 0  # current: only hashed
    module.write_text("def test_sum():\n    assert 2 + 2 == 4\n")
    assert warm(pytestconfig, tmp_path) == 1  # changed: written again
    assert not list((tmp_path / "__pycache__").glob("helper*"))


class _Built:
    """Stands for a pooled stack: only its identity matters to the pool."""


def test_the_pool_tears_down_idle_stacks_at_a_new_file_but_never_the_cached_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torn: list[Any] = []
    monkeypatch.setattr(suite, "teardown_stack", torn.append)
    clock = [1000.0]
    monkeypatch.setattr(suite.time, "monotonic", lambda: clock[0])
    pool = suite.StackPool()
    stdio, http, rabbit = _Built(), _Built(), _Built()
    pool.update({"stdio": stdio, "http": http, "stdio/rabbitmq": rabbit})  # type: ignore[dict-item]
    pool.last_used.update({"stdio": 1000.0, "http": 1000.0, "stdio/rabbitmq": 1000.0})
    pool.cached = "http"
    pool.reap_idle("tests/a.py")
    clock[0] += suite.POOL_IDLE_SECONDS + 1
    pool.used(rabbit)  # type: ignore[arg-type]
    pool.reap_idle("tests/a.py")  # the same file: nothing is torn down mid-file
    assert torn == []
    pool.reap_idle("tests/b.py")
    # stdio was idle too long; http is pytest's cached value; rabbitmq was just used.
    assert torn == [stdio] and set(pool) == {"http", "stdio/rabbitmq"}
