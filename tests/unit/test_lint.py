"""ruff runs with the test suite, so style problems fail the same command as broken behaviour."""

import subprocess
import sys

from proofline.settings import ROOT


def test_ruff_is_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
