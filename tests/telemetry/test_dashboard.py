"""The Grafana dashboard and the compose telemetry files: valid, provisioned from where compose
mounts them, and every series a panel reads is one Proofline exports (checked against the live
endpoints in tests/telemetry/test_metrics.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import yaml

from proofline.settings import ROOT

OPS = ROOT / "ops"


def dashboard() -> dict:
    return json.loads((OPS / "grafana" / "dashboards" / "proofline.json").read_text())


def dashboard_queries() -> list[tuple[str, str]]:
    """Every panel query as written: (panel title and query's refId, PromQL expression)."""
    return [(f"{panel['title']} [{target.get('refId', '?')}]", target["expr"])
            for panel in dashboard()["panels"] for target in panel["targets"]]


def dashboard_series() -> set[str]:
    names: set[str] = set()
    for _, expr in dashboard_queries():
        names |= set(re.findall(r"\bproofline_[a-z_]+", expr))
    return names


def test_dashboard_panels_have_unique_ids_and_queries() -> None:
    panels = dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(p["targets"] for p in panels)
    assert dashboard_series()


def test_prometheus_config_is_valid_and_compose_mounts_what_it_provisions() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: install Debian's prometheus package (.ci/run does)"
    check = subprocess.run([promtool, "check", "config", "prometheus.yml"], cwd=OPS / "prometheus",
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    compose = yaml.safe_load((OPS / "compose.telemetry.yaml").read_text())
    for service in ("prometheus", "grafana", "otel-collector"):
        for volume in compose["services"][service]["volumes"]:
            source = volume.split(":")[0]
            assert (ROOT / source).exists(), (service, source)
    provider = yaml.safe_load((OPS / "grafana" / "provisioning" / "dashboards" / "proofline.yaml").read_text())
    mounted = [v.split(":")[1] for v in compose["services"]["grafana"]["volumes"]]
    assert provider["providers"][0]["options"]["path"] in mounted
