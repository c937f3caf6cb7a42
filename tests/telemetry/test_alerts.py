"""The alert rules: valid, their promtool unit tests pass, and every series they read is one
Proofline exports (a renamed metric must not leave an alert silently watching nothing)."""

from __future__ import annotations

import re
import shutil
import subprocess

import yaml

from proofline.settings import ROOT

RULES = ROOT / "ops" / "prometheus"


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: install Debian's prometheus package (.ci/run does)"
    return path


def test_rules_are_valid_and_their_unit_tests_pass() -> None:
    check = subprocess.run([promtool(), "check", "rules", "alerts.yml"], cwd=RULES, capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run([promtool(), "test", "rules", "alerts_test.yml"], cwd=RULES, capture_output=True,
                           text=True, timeout=120)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "SUCCESS" in tests.stdout


def alert_series() -> set[str]:
    rules = yaml.safe_load((RULES / "alerts.yml").read_text())
    names: set[str] = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            names |= set(re.findall(r"\bproofline_[a-z_]+", rule["expr"]))
    return names


def test_every_alert_has_a_unit_test() -> None:
    rules = yaml.safe_load((RULES / "alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    cases = yaml.safe_load((RULES / "alerts_test.yml").read_text())["tests"]
    firing = {t["alertname"] for c in cases for t in c["alert_rule_test"] if t["exp_alerts"]}
    quiet = {t["alertname"] for c in cases for t in c["alert_rule_test"] if not t["exp_alerts"]}
    assert alerts == firing, alerts ^ firing
    assert alerts == quiet, alerts ^ quiet
