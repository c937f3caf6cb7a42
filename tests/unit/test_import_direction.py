"""Imports point one way: domain <- ledger <- worker <- recovery <- app (Celery app module, controller,
CLI), and no runtime package imports the kit (``proofline_kit``) or ``ops``.

The static part parses every runtime module's imports (module level and inside functions) with
``ast``; the dynamic part imports the lower layers in a fresh interpreter and looks at what that
did: no file opened but code, no process started, no socket, and no Celery loaded below the worker.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from proofline.settings import ROOT

#: The domain: pure definitions every layer shares (envelope, contracts, conditions, canonical
#: form, signing, errors, settings and what they are built from).
DOMAIN = {"proofline", "proofline.bounded", "proofline.canonical", "proofline.cel_limits", "proofline.cel_watchdog",
          "proofline.approvals", "proofline.authority", "proofline.conditions", "proofline.contracts", "proofline.elicitations",
          "proofline.envelope", "proofline.errors", "proofline.errors.authority", "proofline.errors.operator", "proofline.errors.evidence_store", "proofline.keys", "proofline.auditor_keys", "proofline.vault", "proofline.ledger_check", "proofline.plan",
          "proofline.pins", "proofline.reads", "proofline.recheck", "proofline.server_requests", "proofline.settings", "proofline.shards", "proofline.signing", "proofline.validation",
          "proofline.telemetry.observe"}
#: Instrumentation every layer reports through (metric and span definitions, log context): at the
#: bottom like the domain, but outside the no-I/O-at-import check, because prometheus_client reads
#: /proc at import for its process collector.
INSTRUMENTATION = {"proofline.telemetry", "proofline.telemetry.context", "proofline.telemetry.events",
                   "proofline.telemetry.metrics", "proofline.telemetry.tracing", "proofline.telemetry.span_files"}
#: Where worker and recovery tasks are wired together: the one worker module that may import recovery.
CELERY_APP = "worker.tasks"
#: The CLI's entry points into the kit, imported only when their command runs.
KIT_ENTRY_POINTS = {("proofline.commands.runtime", "proofline_kit.demo"), ("proofline.commands.runtime", "ops.soak"),
                    ("proofline.commands.init_cmd", "proofline_kit.devstack")}
#: ``from proofline import Client`` loads the SDK on first use (PEP 562 ``__getattr__``), not at import.
LAZY_EXPORTS = {("proofline", "proofline.client")}
LAYERS = {"domain": 0, "ledger": 1, "worker": 2, "recovery": 3, "app": 4}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str | None:
    top = module.split(".")[0]
    if module in DOMAIN or module in INSTRUMENTATION:
        return "domain"
    if module == CELERY_APP or top == "proofline":
        return "app"
    return top if top in LAYERS else None


def runtime_modules() -> dict[str, Path]:
    found = {}
    for package in ("proofline", "ledger", "worker", "recovery"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" not in path.parts:
                found[module_name(path)] = path
    return found


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every absolute import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from ledger import store`` names the module ledger.store: check the most precise name.
            found += [(f"{node.module}.{alias.name}" if layer(f"{node.module}.{alias.name}") else node.module,
                       id(node) in top) for alias in node.names]
    return found


def wrong_way_arrows() -> list[str]:
    bad = []
    known = runtime_modules()
    for module, path in known.items():
        here = layer(module)
        for target, at_top in imports(path):
            target_top = target.split(".")[0]
            if target_top in ("proofline_kit", "ops"):
                if at_top or (module, target) not in KIT_ENTRY_POINTS:
                    bad.append(f"{module} -> {target}: runtime code never imports the kit")
                continue
            there = layer(target if target in known or target in DOMAIN or target in INSTRUMENTATION else target.rsplit(".", 1)[0])
            if here is None or there is None:
                continue
            if LAYERS[there] > LAYERS[here] and (at_top or (module, target) not in LAZY_EXPORTS):
                bad.append(f"{module} ({here}) -> {target} ({there}): imports point down only")
            if here == "ledger" and target_top in ("celery", "kombu"):
                bad.append(f"{module} -> {target}: the ledger knows no Celery")
    return bad


def test_every_import_points_down_the_layers() -> None:
    assert wrong_way_arrows() == []


def test_the_controller_does_not_validate_with_the_worker() -> None:
    arrows = [target for target, _ in imports(ROOT / "proofline" / "controller.py")]
    assert not [t for t in arrows if t.startswith("worker.validate")], arrows


def test_the_checker_sees_a_wrong_way_arrow(tmp_path: Path) -> None:
    """The checker itself can fail: an arrow up from the ledger, a kit import, Celery in the ledger."""
    probe = tmp_path / "probe.py"
    probe.write_text("from recovery.settle import after_settle\nimport proofline_kit.sor\nfrom celery import Celery\n")
    assert [t for t, _ in imports(probe)] == ["recovery.settle.after_settle", "proofline_kit.sor", "celery"]
    assert layer("recovery.settle") == "recovery" and layer("ledger.store") == "ledger"
    assert LAYERS[layer("recovery.settle")] > LAYERS[layer("ledger.store")]


def test_worker_execute_stays_under_the_module_ceiling() -> None:
    assert len((ROOT / "worker" / "execute.py").read_text().splitlines()) < 600


#: Run in a fresh interpreter: import the modules, report what the imports did.
PROBE = r"""
import json, sys
events = []
def hook(event, args):
    if event == "open" and isinstance(args[0], str | bytes):
        path = args[0].decode() if isinstance(args[0], bytes) else args[0]
        # Code, and package metadata (pydantic looks up its plugins' entry points): not the domain's I/O.
        code = (".py", ".pyc", ".so", ".pth", ".typed", ".zip", "entry_points.txt", "__path_hook__")
        if not path.endswith(code) and not path.endswith("/"):
            import os
            if not os.path.isdir(path):
                events.append(("open", path))
    elif event in ("subprocess.Popen", "socket.connect", "os.system"):
        events.append((event, repr(args)[:200]))
import pydantic, yaml, cryptography  # third-party imports may read their own data files
sys.addaudithook(hook)
for name in sys.argv[1:]:
    __import__(name)
print(json.dumps({"events": events, "celery": "celery" in sys.modules}))
"""


def _probe(modules: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_domain_does_no_io_at_import() -> None:
    report = _probe(sorted(DOMAIN))
    assert report["events"] == []
    assert not report["celery"]


@pytest.mark.parametrize("package", ["ledger"])
def test_the_ledger_loads_no_celery(package: str) -> None:
    modules = [m for m in runtime_modules() if m.split(".")[0] == package]
    assert not _probe(modules)["celery"]


def test_the_console_is_app_layer_and_nothing_below_imports_it() -> None:
    """The operator console (``proofline/console/``) sits with the CLI: it may use every layer,
    and no domain, ledger, worker or recovery module may import it."""
    console = [m for m in runtime_modules() if m.startswith("proofline.console")]
    assert "proofline.console.app" in console and all(layer(m) == "app" for m in console)
    for module, path in runtime_modules().items():
        if layer(module) != "app":
            assert not [t for t, _ in imports(path) if t.startswith("proofline.console")], module
