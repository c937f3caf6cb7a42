"""The documentation site and the README that leads into it.

The site is built with ``mkdocs build --strict`` (any warning fails it: a broken link, a missing
anchor, a page the nav names that does not exist); the reference pages rendered from the code must
hold every setting, command and reason code; the published JSON Schemas must equal the models;
every relative link of the README and of the docs must resolve; and the README stays a front door.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from ops import docs_reference
from proofline.settings import ROOT, Settings

DOCS = ROOT / "docs"
README = ROOT / "README.md"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
#: Files the build hook publishes into the site from outside docs/ (docs/hooks/reference.py).
GENERATED = {"reference/schemas/envelope.v1.json", "design/capacity.md"}


def build(config_dir: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config_dir / "mkdocs.yml"),
                           "-d", str(site)], cwd=config_dir, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(site.parent)})


def test_the_site_builds_strict_with_the_reference_rendered_from_the_code(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = build(ROOT, site)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    settings = (site / "reference" / "settings" / "index.html").read_text()
    for name in Settings.model_fields:
        assert f"PROOFLINE_{name.upper()}" in settings, name
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for path in ("proofline worker", "proofline keys rotate", "proofline contracts pin", "proofline manual resolve"):
        assert f"Usage: {path} [OPTIONS]" in cli, path
    codes = (site / "reference" / "reason-codes" / "index.html").read_text()
    assert "envelope_bad_signature" in codes and "lease_busy" in codes
    for page in site.rglob("*.html"):
        assert "<!-- reference:" not in page.read_text(), page  # every marker was replaced
    for name in ("contract.schema.json", "servers.schema.json", "envelope.v1.json"):
        assert (site / "reference" / "schemas" / name).is_file(), name


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The build's own link checks are what the test above relies on: a link to a missing page and
    an anchor no heading has must each stop it."""
    copy = tmp_path / "copy"
    shutil.copytree(DOCS, copy / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    (copy / "ops").symlink_to(ROOT / "ops")
    (copy / "schemas").symlink_to(ROOT / "schemas")
    index = copy / "docs" / "index.md"
    index.write_text(index.read_text() + "\n[gone](no-such-page.md) [nowhere](concepts/lease.md#no-such-heading)\n")
    done = build(copy, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stderr and "no-such-heading" in done.stderr, done.stderr


def test_the_published_schemas_are_the_models() -> None:
    for name in docs_reference.SCHEMAS:
        committed = (docs_reference.SCHEMA_DIR / name).read_text()
        assert committed == docs_reference.schema_text(name), f"{name}: run python -m ops.docs_reference schemas"


def test_the_servers_schema_takes_what_the_loader_takes(tmp_path: Path) -> None:
    """Every top-level field the schema allows for a server is one the loader accepts."""
    import yaml

    from worker.servers import load_servers

    schema = docs_reference.servers_schema()
    server = schema["$defs"]["Server"]["properties"]
    assert set(server) >= {"transport", "command", "url", "sandbox", "read_identity", "expected_version"}
    sample = {"transport": "http", "url": "http://127.0.0.1:9/mcp", "expected_version": "1",
              "max_result_bytes": 1000, "tool_list_max_age_seconds": 0, "read_identity": {}}
    assert set(sample) <= set(server)
    path = tmp_path / "servers.yaml"
    path.write_text(yaml.safe_dump({"servers": {"x": sample}}))
    assert load_servers(path)["x"].tool_list_max_age_seconds == 0


def test_every_reference_renderer_covers_its_source() -> None:
    from proofline import errors

    settings = docs_reference.render("settings")
    rows = [line for line in settings.splitlines() if line.startswith("| `PROOFLINE_")]
    assert len(rows) >= len(Settings.model_fields)
    codes = docs_reference.render("reason-codes")
    for cls in vars(errors).values():
        if isinstance(cls, type) and issubclass(cls, errors.ProoflineError):
            assert f"| `{cls.code}` |" in codes, cls
    with pytest.raises(KeyError, match="no reference named"):
        docs_reference.render("nothing")


def test_every_alert_has_a_runbook() -> None:
    """Each rule of ops/prometheus/alerts.yml has its own section in the metrics reference."""
    runbooks = (DOCS / "reference" / "metrics.md").read_text()
    names = [rule["alert"] for rule in docs_reference.alert_rules()]
    assert len(names) >= 11
    for name in names:
        assert f"\n### {name}\n" in runbooks, name


def slug(heading: str) -> str:
    """The anchor MkDocs gives a heading (Python-Markdown's toc slugify on its text)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    for target in links(page):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not this test's business
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        inside_site = page.is_relative_to(DOCS) and resolved.is_relative_to(DOCS)
        generated = inside_site and resolved.relative_to(DOCS).as_posix() in GENERATED
        assert resolved.exists() or generated, f"{page.relative_to(ROOT)}: {target} does not exist"
        if page.is_relative_to(DOCS) and resolved.exists():
            assert resolved.is_relative_to(DOCS), f"{page.relative_to(ROOT)}: {target} leaves the site"
        if fragment and resolved.suffix == ".md" and resolved.exists():
            assert fragment in anchors(resolved), f"{page.relative_to(ROOT)}: {target} has no such heading"


def test_nothing_points_at_the_developers_shared_notes() -> None:
    for page in [*pages(), ROOT / "mkdocs.yml"]:
        text = page.read_text()
        assert "/work/shared" not in text and "../shared" not in text, page


def test_the_readme_is_a_front_door_that_starts_with_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 250
    # .ci/run reads the test command with exactly this sed expression.
    ci = subprocess.run(["sed", "-n", "/<!-- test-command -->/{n;n;p;}", str(README)], capture_output=True,
                        text=True, check=True).stdout
    assert ci == ("python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && "
                  ".venv/bin/python -m pytest -n 6 --dist loadgroup\n")
    demo = subprocess.run(["sed", "-n", "/<!-- demo-command -->/{n;n;p;}", str(README)], capture_output=True,
                          text=True, check=True).stdout
    assert demo == "python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/proofline demo\n"
    head = text.split("\n---\n", 1)[0]  # the commands come before anything else
    assert head.index("<!-- demo-command -->") < head.index("<!-- test-command -->")
    for part in ("docs/tutorial/run-the-demo.md", "docs/reference/cli.md", "docs/concepts/index.md"):
        assert f"]({part})" in text, part
