"""Break each protection listed in ``ops/mutations.yaml`` in turn and check that its tests go red.

Every entry names a file, an exact snippet and the edit that breaks the protection, and the tests
that must fail with that edit and pass without it. The edits are made in a throw-away copy of the
tree (the files git tracks plus untracked ones it does not ignore), never in the working tree, so
an interrupted run leaves nothing mutated; the copy goes with the run, Ctrl-C included. The
copy's directory comes first on ``PYTHONPATH``, so the workers, recovery and the migrations the
tests start import the mutated code.

    python -m ops.mutation_check --all          # every entry
    python -m ops.mutation_check --only ID ...  # the named entries
    python -m ops.mutation_check --rotate 2     # two entries, a different pair for each commit

Each entry's result: ``caught`` (every named test failed), ``SURVIVED`` (a named test still
passed: the protection is not pinned), ``stale`` (the snippet is not in the file exactly once),
``baseline`` (a named test fails without the mutant, so it proves nothing). The exit status is
non-zero unless every selected entry was caught.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "ops" / "mutations.yaml"
#: How long one pytest run (one entry's tests, or the baseline) may take before it is stopped.
RUN_TIMEOUT_SECONDS = 1800.0


@dataclass(frozen=True)
class Mutation:
    id: str
    promise: str
    file: str
    snippet: str
    mutant: str
    tests: tuple[str, ...]


def load(path: Path = LIST) -> list[Mutation]:
    """The entries of the list, checked for shape (not yet for their snippets)."""
    entries = yaml.safe_load(path.read_text())["mutations"]
    found = []
    for entry in entries:
        missing = {"id", "promise", "file", "snippet", "mutant", "tests"} - set(entry)
        if missing:
            raise ValueError(f"{path}: entry {entry.get('id', '?')} lacks {sorted(missing)}")
        if entry["snippet"] == entry["mutant"] or not entry["tests"]:
            raise ValueError(f"{path}: entry {entry['id']} changes nothing or names no test")
        found.append(Mutation(entry["id"], entry["promise"], entry["file"], entry["snippet"], entry["mutant"],
                              tuple(entry["tests"])))
    ids = [m.id for m in found]
    if len(ids) != len(set(ids)):
        raise ValueError(f"{path}: duplicate ids")
    return found


def occurrences(mutation: Mutation, root: Path = ROOT) -> int:
    """How often the entry's snippet appears in its file (1, or the entry is stale)."""
    path = root / mutation.file
    return path.read_text().count(mutation.snippet) if path.is_file() else 0


def line_of(mutation: Mutation, root: Path = ROOT) -> int:
    text = (root / mutation.file).read_text()
    return text[: text.index(mutation.snippet)].count("\n") + 1


def rotation(entries: list[Mutation], n: int, seed: str) -> list[Mutation]:
    """``n`` consecutive entries (in id order, wrapping) starting at a place the seed decides: each
    commit (or day) checks another slice, and the whole list comes round in turn."""
    ordered = sorted(entries, key=lambda m: m.id)
    if n >= len(ordered):
        return ordered
    start = int(hashlib.sha256(seed.encode()).hexdigest(), 16) % len(ordered)
    return [ordered[(start + i) % len(ordered)] for i in range(n)]


def default_seed() -> str:
    """The commit checked out (so CI checks a different slice on each commit), else today's date."""
    if seed := os.environ.get("PROOFLINE_MUTATION_SEED"):
        return seed
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return datetime.now(UTC).date().isoformat()


def copy_tree(dest: Path) -> None:
    """The files of the working tree (tracked, and untracked unless ignored), symlinks kept."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree, not yet in the index
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            target.symlink_to(os.readlink(src))
        elif src.is_file():
            shutil.copy2(src, target)


def run_tests(tree: Path, tests: list[str], report: Path) -> dict[str, str]:
    """Run ``tests`` in ``tree``; returns each named test's status (see :func:`outcomes`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *tests]
    try:
        subprocess.run(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=RUN_TIMEOUT_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        return {t: FAILED for t in tests}  # a hang is red: the named tests did not pass
    return outcomes(report, tests)


#: A named test's status: every case passed; a case failed or errored; no case ran (or one was skipped).
PASSED, FAILED, NOT_RUN = "passed", "failed", "not run"


def outcomes(report: Path, tests: list[str]) -> dict[str, str]:
    """Per named test (``path::name``, all its parametrised cases together): ``failed`` when any case
    failed or errored, ``passed`` when every case passed, ``not run`` otherwise (none ran, or one
    was skipped: a skip proves nothing either way)."""
    cases: dict[str, list[str]] = {t: [] for t in tests}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name', '').split('[')[0]}"
            if node in cases:
                tags = {child.tag for child in case}
                cases[node].append(FAILED if tags & {"failure", "error"} else NOT_RUN if "skipped" in tags
                                   else PASSED)
    return {t: FAILED if FAILED in seen else PASSED if seen and set(seen) == {PASSED} else NOT_RUN
            for t, seen in cases.items()}


def check(selected: list[Mutation], out=print) -> list[tuple[Mutation, str, str]]:
    """Baseline once for the union of the tests, then each mutant in turn. Returns (entry, where, result)."""
    rows: list[tuple[Mutation, str, str]] = []
    live = []
    for m in selected:
        count = occurrences(m)
        if count != 1:
            rows.append((m, f"{m.file}:?", f"stale (snippet found {count} times)"))
        else:
            live.append(m)
    with tempfile.TemporaryDirectory(prefix="proofline-mutants-") as tmp:
        tree, reports = Path(tmp) / "tree", Path(tmp) / "reports"
        tree.mkdir()
        reports.mkdir()
        copy_tree(tree)
        union = list(dict.fromkeys(t for m in live for t in m.tests))
        out(f"baseline: {len(union)} test(s) unmutated")
        baseline = run_tests(tree, union, reports / "baseline.xml") if union else {}
        for m in live:
            where = f"{m.file}:{line_of(m)}"
            red = [t for t in m.tests if baseline[t] != PASSED]
            if red:
                rows.append((m, where, f"baseline (not green unmutated: {', '.join(red)})"))
                continue
            path = tree / m.file
            original = path.read_text()
            path.write_text(original.replace(m.snippet, m.mutant, 1))
            try:
                out(f"mutant {m.id}: {where}")
                result = run_tests(tree, list(m.tests), reports / f"{m.id}.xml")
            finally:
                path.write_text(original)
            survivors = [f"{t} {status}" for t, status in result.items() if status != FAILED]
            rows.append((m, where, f"SURVIVED ({', '.join(survivors)})" if survivors else "caught"))
    order = {m.id: i for i, m in enumerate(selected)}
    return sorted(rows, key=lambda r: order[r[0].id])


def table(rows: list[tuple[Mutation, str, str]]) -> str:
    lines = ["| id | mutated at | tests | result |", "|---|---|---|---|"]
    for m, where, result in rows:
        tests = "<br>".join(f"`{t}`" for t in m.tests)
        lines.append(f"| `{m.id}` | `{where}` | {tests} | {result} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.mutation_check", description=__doc__.split("\n\n")[0])
    pick = parser.add_mutually_exclusive_group(required=True)
    pick.add_argument("--all", action="store_true", help="every entry of ops/mutations.yaml")
    pick.add_argument("--only", nargs="+", metavar="ID", help="the named entries")
    pick.add_argument("--rotate", type=int, metavar="N", help="N entries, a slice chosen by the seed")
    pick.add_argument("--list", action="store_true", help="print the entries and stop")
    parser.add_argument("--seed", default=None, help="what --rotate slices by (default: the commit, else the date)")
    args = parser.parse_args(argv)
    entries = load()
    if args.list:
        for m in entries:
            print(f"{m.id}: {m.promise}")
        return 0
    if args.all:
        selected = entries
    elif args.only:
        unknown = set(args.only) - {m.id for m in entries}
        if unknown:
            parser.error(f"no such entries: {', '.join(sorted(unknown))}")
        selected = [m for m in entries if m.id in args.only]
    else:
        selected = rotation(entries, args.rotate, args.seed or default_seed())
    rows = check(selected, out=lambda s: print(s, file=sys.stderr, flush=True))
    print(table(rows))
    return 0 if all(result == "caught" for _, _, result in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
