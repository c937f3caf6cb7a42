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


#: The visible mark of a block a guide's test does not run, on the lines just above its fence: an
#: admonition a reader sees, saying why (``!!! note "Not run by the test suite: needs Docker"``).
NOT_RUN = re.compile(r'!!! note "Not run by the test suite: [^"\n]+"\n\n$')
#: The languages a guide's test runs: shell and Python as the reader would, SQL through psql.
RUN = ("sh", "bash", "python", "sql")


def guide_blocks(page: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """A how-to page's blocks to run, in order, as (language, body), and the reasons given for
    the blocks it marks as not run. Output blocks (``text``, or no language) are never run."""
    text = page.read_text()
    run, skipped = [], []
    for found in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```$", text, re.S | re.M):
        indent, lang, body = found.groups()
        if lang not in RUN:
            continue
        marked = NOT_RUN.search(text[max(0, found.start() - 300):found.start()].replace(f"\n{indent}", "\n"))
        if marked:
            skipped.append(marked.group(0).split(": ", 1)[1].split('"')[0])
            continue
        lines = [line[len(indent):] if line.startswith(indent) else line for line in body.splitlines(True)]
        run.append((lang, "".join(lines)))
    return run, skipped


def guide_script(found: list[tuple[str, str]]) -> str:
    """One bash script: shell blocks as they are, Python blocks through ``python``, SQL through
    ``psql`` as the reader role (the role an operator reads the ledger with)."""
    lines = ["set -euo pipefail"]
    for lang, body in found:
        if lang in ("sh", "bash"):
            lines.append(body)
        elif lang == "python":
            lines.append(f"python - <<'GUIDE_EOF'\n{body}GUIDE_EOF")
        else:
            lines.append(f"psql \"${{PROOFLINE_READER_DATABASE_URL:-$PROOFLINE_DATABASE_URL}}\" -v ON_ERROR_STOP=1 "
                         f"-X -q <<'GUIDE_EOF'\n{body}GUIDE_EOF")
    return "\n".join(lines) + "\n"
