"""Each dependency is declared once in ``pyproject.toml``: three ``cryptography`` lines once stood
for three reasons, which a reader had to reconcile and an upgrade had to change three times."""

from __future__ import annotations

import re
import tomllib
from collections import Counter

from proofline.settings import ROOT


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_every_dependency_is_listed_once_per_list() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lists = {"dependencies": project["dependencies"], **project.get("optional-dependencies", {})}
    for name, requirements in lists.items():
        twice = [n for n, count in Counter(_name(r) for r in requirements).items() if count > 1]
        assert not twice, f"{name} lists {twice} more than once"
