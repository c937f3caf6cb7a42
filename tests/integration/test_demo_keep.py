"""``proofline demo --keep`` says how to stop what it leaves running, and ``proofline demo --stop``
stops it: the embedded Postgres's postmaster is gone afterwards. The demo's state lives in the
state folder it was given (by default one per installed copy, never shared by two checkouts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from proofline.settings import ROOT, default_state_dir
from proofline_kit import zygote
from proofline_kit.processes import gone

pytestmark = pytest.mark.timeout(600)


def _demo(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return zygote.run([sys.executable, "-m", "proofline", "demo", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=480)


def test_keep_says_how_to_stop_and_stop_stops_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "SOR_"))}
    env["PROOFLINE_STATE_DIR"] = str(tmp_path / "state")
    kept = _demo(env, "--keep")
    pgdata = tmp_path / "state" / "var" / "demo" / "pg"
    try:
        assert kept.returncode == 0, kept.stdout[-3000:] + kept.stderr[-3000:]
        assert f"(its data in {pgdata}); stop it with: proofline demo --stop" in kept.stdout, kept.stdout[-2000:]
        postmaster = psutil.Process(int((pgdata / "postmaster.pid").read_text().split()[0]))
        assert postmaster.is_running()
        stopped = _demo(env, "--stop")
        assert stopped.returncode == 0 and stopped.stdout.strip() == f"stopped the demo's Postgres in {pgdata}"
        assert gone(postmaster)
        again = _demo(env, "--stop")
        assert again.returncode == 0 and again.stdout.strip() == f"no demo Postgres is running in {pgdata}"
    finally:
        _demo(env, "--stop")


def test_each_installed_copy_has_its_own_default_state_folder() -> None:
    one, other = Path("/srv/a/proofline"), Path("/home/b/checkout/proofline")
    assert default_state_dir(one) == default_state_dir(one)
    assert default_state_dir(one) != default_state_dir(other)
    assert default_state_dir(one).parent.name == "proofline" and default_state_dir(one).name.startswith("install-")
