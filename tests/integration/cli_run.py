"""Run the real ``proofline`` command line in a subprocess against a stack, and check the error
contract: exactly one line on stderr, the exit code of its class, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from proofline.settings import ROOT
from proofline_kit import zygote
from tests.conftest import Stack


def environment(stack: Stack, env: dict[str, str] | None = None) -> dict[str, str]:
    """The stack's Proofline settings in this process's environment, plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PROOFLINE_", "SOR_"))}
    base.update({k: v for k, v in stack.env.items() if k.startswith(("PROOFLINE_", "SOR_"))})
    return {**base, **(env or {}), "PYTHONPATH": str(ROOT)}


def proofline(stack: Stack, *args: str, env: dict[str, str] | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return zygote.run([sys.executable, "-m", "proofline", *args], env=environment(stack, env), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def assert_error(out: subprocess.CompletedProcess[str], exit_code: int, code: str, *words: str) -> str:
    """The command failed with ``exit_code``: one line on stderr naming ``code``, nothing on stdout."""
    assert out.returncode == exit_code, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == "", (out.stdout, out.stderr)
    assert lines[0].startswith(f"proofline: {code}: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def as_json(out: subprocess.CompletedProcess[str]) -> Any:
    """A ``--json`` run: exit 0 and exactly one JSON document on stdout."""
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def text(out: subprocess.CompletedProcess[str]) -> str:
    """A text-mode run: exit 0 and no JSON document anywhere in stdout."""
    assert out.returncode == 0, out.stderr
    for line in out.stdout.splitlines():
        assert not line.lstrip().startswith(("{", "[")), line
    return out.stdout
