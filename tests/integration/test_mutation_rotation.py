"""The rotating slice of the mutation table (``ops/mutations.yaml``): each run breaks a few of the
listed protections in a throw-away copy of the tree and fails when any of them survives its tests.

The slice follows the commit checked out, so successive commits check different protections and the
whole list comes round. ``PROOFLINE_MUTATION_ROTATE`` sets its size (default 2);
``PROOFLINE_MUTATION_ALL=1`` runs the whole list (on demand: it takes a while).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ops.mutation_check import ROOT


# Each entry runs its tests twice (unmutated, then mutated), some of them through stacks of workers.
@pytest.mark.timeout(3600)
def test_the_rotating_slice_of_the_mutation_table_is_caught() -> None:
    pick = ["--all"] if os.environ.get("PROOFLINE_MUTATION_ALL") == "1" else [
        "--rotate", os.environ.get("PROOFLINE_MUTATION_ROTATE", "2")]
    done = subprocess.run([sys.executable, "-m", "ops.mutation_check", *pick], cwd=ROOT, capture_output=True,
                          text=True, timeout=3500, check=False)
    assert done.returncode == 0, f"a protection survived its mutation (or an entry is stale):\n{done.stdout}\n{done.stderr}"
    assert "| caught |" in done.stdout
