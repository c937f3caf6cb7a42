"""MkDocs hook: reference pages rendered from the code at build time (``ops/docs_reference.py``),
and files that live outside ``docs/`` published into the site so pages can link them."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ops.docs_reference import expand  # noqa: E402

#: site path -> the repository file it is built from
OUTSIDE = {"reference/schemas/envelope.v1.json": ROOT / "schemas" / "envelope.v1.json",
           "design/capacity.md": ROOT / "ops" / "CAPACITY.md"}


def on_files(files, config):
    for uri, source in OUTSIDE.items():
        files.append(File.generated(config, uri, content=source.read_text()))
    return files


def on_page_markdown(markdown, page, config, files):
    return expand(markdown)
