"""A real Prometheus server for the telemetry tests: Debian's ``prometheus`` binary on loopback,
configured from the compose stack's own ``ops/prometheus/prometheus.yml`` (its jobs, its rule
files) with the service discovery replaced by the test stack's loopback endpoints, and read
through its HTTP API."""

from __future__ import annotations

import glob
import json
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from proofline.settings import ROOT
from proofline_kit.processes import start_process, stop_process, wait_for, wait_port

CONFIG_DIR = ROOT / "ops" / "prometheus"
#: How often the test server scrapes every target and evaluates the rules.
INTERVAL = "1s"
_LISTENING = re.compile(r'msg="Listening on" address=127\.0\.0\.1:(\d+)')


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    assert path, "prometheus is missing: install Debian's prometheus package (.ci/run does)"
    return path


def compose_config() -> dict[str, Any]:
    """The Prometheus configuration the compose stack mounts."""
    return yaml.safe_load((CONFIG_DIR / "prometheus.yml").read_text())


def rule_files(config: dict[str, Any]) -> list[Path]:
    """The rule files ``config`` loads, resolved as Prometheus does (relative to the config's
    directory, globs allowed); a pattern that matches nothing fails."""
    files: list[Path] = []
    for pattern in config.get("rule_files", []):
        matched = sorted(glob.glob(str(CONFIG_DIR / pattern)))
        assert matched, f"rule_files entry {pattern!r} of ops/prometheus/prometheus.yml matches no file"
        files += [Path(m) for m in matched]
    return files


def loopback_config(targets: dict[str, list[str]]) -> dict[str, Any]:
    """The compose configuration with every job's targets given statically (``targets`` by job
    name: every job the compose file scrapes must have some), the rule files by absolute path,
    and scraping and evaluation every ``INTERVAL``."""
    compose = compose_config()
    jobs = [job["job_name"] for job in compose["scrape_configs"]]
    assert sorted(jobs) == sorted(targets), f"ops/prometheus/prometheus.yml scrapes {jobs}, the test {sorted(targets)}"
    scrape_configs = []
    for job in compose["scrape_configs"]:
        kept = {k: v for k, v in job.items()
                if not k.endswith("_sd_configs") and k not in ("static_configs", "scrape_interval", "scrape_timeout")}
        scrape_configs.append({**kept, "static_configs": [{"targets": targets[job["job_name"]]}]})
    return {"global": {**compose.get("global", {}), "scrape_interval": INTERVAL, "evaluation_interval": INTERVAL},
            "rule_files": [str(f) for f in rule_files(compose)],
            "scrape_configs": scrape_configs}


class PrometheusServer:
    """``prometheus`` started in its own session on 127.0.0.1, port 0 (it logs the port it bound),
    its TSDB in ``workdir``; ``stop()`` ends it by its pid."""

    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        self.workdir = workdir
        self.config = config
        self.config_file = workdir / "prometheus.yml"
        self.config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self, timeout: float = 30.0) -> None:
        argv = [prometheus_binary(), f"--config.file={self.config_file}",
                f"--storage.tsdb.path={self.workdir / 'data'}", "--storage.tsdb.retention.time=1h",
                "--web.listen-address=127.0.0.1:0"]
        self.proc = start_process(argv, {"PATH": "/usr/bin:/bin", "HOME": str(self.workdir)}, self.log,
                                  cwd=self.workdir)
        self.port = wait_for(self._reported_port, timeout, interval=0.1, what="prometheus to report its port")
        wait_port(self.port, timeout)
        wait_for(self._ready, timeout, interval=0.2, what="prometheus to be ready")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def _reported_port(self) -> int | None:
        found = _LISTENING.search(self.log.read_text()) if self.log.exists() else None
        if found:
            return int(found.group(1))
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
        return None

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5) as r:  # noqa: S310
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:]) if self.log.exists() else ""

    def call(self, path: str, **params: str) -> dict[str, Any]:
        """An API response as JSON, error responses (400, 422, 503) included."""
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            return json.loads(error.read())

    def data(self, path: str, **params: str) -> Any:
        answer = self.call(path, **params)
        assert answer["status"] == "success", (path, params, answer)
        return answer["data"]

    def configured_targets(self) -> list[tuple[str, str]]:
        """(job, scrape URL) of every static target in the configuration."""
        return sorted((job["job_name"], f"http://{target}{job.get('metrics_path', '/metrics')}")
                      for job in self.config["scrape_configs"]
                      for static in job["static_configs"] for target in static["targets"])

    def targets(self) -> list[dict[str, Any]]:
        return self.data("/api/v1/targets", state="active")["activeTargets"]

    def rule_groups(self) -> list[dict[str, Any]]:
        return self.data("/api/v1/rules")["groups"]

    def query(self, expr: str) -> dict[str, Any]:
        return self.call("/api/v1/query", query=expr)

    def scalar(self, expr: str) -> float:
        """The value of an expression that returns at most one series (none counts as 0)."""
        result = self.data("/api/v1/query", query=expr)["result"]
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else 0.0
