"""The scripts under ``ops/`` (benchmarks, the soak, the mutation table) still import.

Most of them run only when someone measures, so a name moved in the product breaks them silently:
``ops/bench_sandbox.py`` went on importing the audit reader from the module it had left. They are
imported one after another in a fresh interpreter (one for all of them: a second import of a shared
module costs nothing), and nothing but the import runs.
"""

from __future__ import annotations

import subprocess
import sys

from proofline.settings import ROOT

SCRIPTS = sorted(p.stem for p in (ROOT / "ops").glob("*.py") if p.stem != "__init__")

CHECK = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module("ops." + name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=1).strip().splitlines()[-1])
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_there_are_scripts_to_check() -> None:
    assert {"bench_sandbox", "soak", "worker_start_bench", "mutation_check"} <= set(SCRIPTS)


def test_every_ops_script_imports() -> None:
    done = subprocess.run([sys.executable, "-c", CHECK, *SCRIPTS], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, f"ops scripts that no longer import:\n{done.stdout}{done.stderr[-2000:]}"
