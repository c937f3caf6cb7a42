"""Documentation pages run as written: their fenced blocks turned into one bash script, the way a
reader follows them. Used by the tests of the tutorial and the how-to guides."""

from __future__ import annotations

import re
from pathlib import Path

FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)
#: A block the page marks for its test (``<!-- tutorial-test -->`` on the line above the fence).
MARKED = re.compile(r"^<!-- tutorial-test -->\n```(\w+)\n(.*?)^```$", re.S | re.M)


def blocks(page: Path, marked_only: bool = False) -> list[tuple[str, str]]:
    """The page's fenced blocks in order, as (language, body): all of them, or the marked ones."""
    return (MARKED if marked_only else FENCE).findall(page.read_text())


def as_script(found: list[tuple[str, str]]) -> str:
    """One bash script doing what the reader does: run the shell blocks, save the files the YAML
    and Python blocks name on their first line (``# file: PATH``), run the other Python blocks."""
    lines = ["set -euo pipefail"]
    for lang, body in found:
        target = re.match(r"# file: (\S+)\n", body)
        if lang == "bash":
            lines.append(body)
        elif lang in ("yaml", "python") and target:
            lines += [f"mkdir -p \"$(dirname {target.group(1)})\"",
                      f"cat > {target.group(1)} <<'GUIDE_EOF'\n{body}GUIDE_EOF"]
        elif lang == "yaml":
            raise AssertionError(f"a YAML block of the page names no file: {body[:80]!r}")
        elif lang == "python":
            lines.append(f"python - <<'GUIDE_EOF'\n{body}GUIDE_EOF")
    return "\n".join(lines) + "\n"
