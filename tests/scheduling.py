"""How the suite is spread over xdist workers (``-n 6 --dist loadgroup``, the README's command).

Groups: a group runs whole on one worker, in order, so whatever its tests share (a module's own
stack, a package's deployment) is built once. A test file is a group of its own; the console's
browser tests (one console process on one session stack) and the telemetry tests (one observed
deployment, a package-scoped fixture) are one group each (:data:`SHARED_FOLDERS`).

The groups are computed here from the test's node id, by a scheduler of our own: xdist's
``loadgroup`` reads ``xdist_group`` marks by appending the group to each node id, which pytest 9's
node ids ignore, so under it every test was scheduled on its own and a module's stack was built
on every worker that ran one of its tests.

Order: xdist hands the groups out in the order the workers collected them, one or two at a time,
to whichever worker is nearly done. The longest groups go first (by the seconds each file took when
last measured, ``tests/durations.json``), so that a long file is not the one still running when
every other worker has finished; the many quick unit files fill the gaps at the end. Within a
group the order is pytest's own (tests sharing a parametrised fixture stay together). Without
xdist nothing is reordered.

``python -m tests.scheduling REPORT.xml`` rewrites ``tests/durations.json`` from a JUnit report
of a whole run (``--junitxml REPORT.xml``).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

DURATIONS = Path(__file__).resolve().parent / "durations.json"
#: Seconds assumed for a test of a file the table does not know yet.
UNKNOWN_TEST_SECONDS = 2.0
#: Folders whose files share a deployment built once per process: each folder is one group.
SHARED_FOLDERS = ("tests/console/", "tests/telemetry/")


def group_of(nodeid: str) -> str:
    """The group of the test ``nodeid`` (see the module's docstring)."""
    path = nodeid.split("::", 1)[0]
    for folder in SHARED_FOLDERS:
        if path.startswith(folder):
            return folder.rstrip("/")
    return path


def file_seconds() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError):
        return {}


def longest_groups_first(nodeids: list[str]) -> list[int]:
    """The order (indices into ``nodeids``) that runs the groups by descending estimated time,
    each group's tests in the order they had."""
    measured = file_seconds()
    per_file: dict[str, int] = defaultdict(int)
    for nodeid in nodeids:
        per_file[nodeid.split("::", 1)[0]] += 1
    weight: dict[str, float] = defaultdict(float)
    first_seen: dict[str, int] = {}
    groups = [group_of(nodeid) for nodeid in nodeids]
    for index, (nodeid, group) in enumerate(zip(nodeids, groups, strict=True)):
        path = nodeid.split("::", 1)[0]
        first_seen.setdefault(group, index)
        weight[group] += measured[path] / per_file[path] if path in measured else UNKNOWN_TEST_SECONDS
    return sorted(range(len(nodeids)), key=lambda i: (-weight[groups[i]], first_seen[groups[i]], i))


class _LongestGroupsFirst:
    """Registered on xdist workers only: they collect, and the controller hands the groups out in
    the order the workers' collection has them."""

    @pytest.hookimpl(trylast=True)  # after pytest's own reordering by parametrised fixtures
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        order = longest_groups_first([item.nodeid for item in items])
        items[:] = [items[i] for i in order]


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        config.pluginmanager.register(_LongestGroupsFirst(), "proofline-longest-groups-first")
    elif config.getoption("numprocesses", None) and config.getoption("assertmode") == "rewrite":
        # The xdist controller, before it starts the workers: they read the rewritten test modules
        # instead of each rewriting them again (tests/rewrite_cache.py).
        from tests.rewrite_cache import warm

        warm(config, Path(__file__).resolve().parent)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown to pytest without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: xdist's scope scheduling over :func:`group_of`'s groups, in collection
    order (not xdist's largest-group-by-test-count first: a file of 97 quick unit tests is not a
    long group, a fault test of two that kills brokers is)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)


def durations_from_junit(report: Path) -> dict[str, float]:
    """Seconds per test file from a JUnit report (each testcase's time: setup, call and teardown)."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        # classname is the module's dotted path (tests.unit.test_x), plus a class name for methods.
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        if parts:
            seconds["/".join(parts) + ".py"] += float(case.get("time") or 0)
    return dict(sorted((k, round(v, 1)) for k, v in seconds.items()))


if __name__ == "__main__":
    DURATIONS.write_text(json.dumps(durations_from_junit(Path(sys.argv[1])), indent=1) + "\n")
