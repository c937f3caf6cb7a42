"""The stack as a real Prometheus server sees it: Debian's ``prometheus`` scrapes both workers'
endpoints and the exporter every second (the compose stack's jobs and rule files, on loopback),
while the stack runs the mixed batch. Then every target is up, the key series Prometheus stored
are the ledger's counts, every alert rule loaded from the compose stack's rule files evaluates
without error, and every query the Grafana dashboard makes runs against the live series."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from tests.conftest import wait_for
from tests.telemetry.conftest import Observed
from tests.telemetry.helpers import mixed_batch, start_exporter
from tests.telemetry.prometheus_server import (
    PrometheusServer,
    compose_config,
    loopback_config,
    prometheus_binary,
    rule_files,
)
from tests.telemetry.test_dashboard import dashboard, dashboard_queries

WORKERS_JOB, EXPORTER_JOB = "proofline-workers", "proofline-exporter"

VERIFIED_SQL = ("SELECT count(*) AS n FROM ledger_events WHERE event = 'verification_finished' "
                "AND evidence->>'finding' = 'expected'")
STARTED_SQL = "SELECT count(*) AS n FROM ledger_events WHERE event = 'idempotency_claimed'"

#: Series Prometheus stored, each with the ledger's own count of the same thing.
KEY_SERIES: dict[str, tuple[str, str]] = {
    "verified (exporter)": ('sum(proofline_ledger_verifications_total{finding="expected"})', VERIFIED_SQL),
    "verified (workers)": (f'sum(proofline_verifications_total{{job="{WORKERS_JOB}",finding="expected"}})',
                           VERIFIED_SQL),
    "started (exporter)": ("sum(proofline_ledger_actions_started_total)", STARTED_SQL),
    "started (workers)": (f'sum(proofline_actions_started_total{{job="{WORKERS_JOB}"}})', STARTED_SQL),
    "unknown-outcome calls": ('sum(proofline_ledger_tool_calls_total{outcome="unknown_outcome"})',
                              "SELECT count(*) AS n FROM ledger_events WHERE event = 'tool_called' "
                              "AND evidence->>'outcome' = 'unknown_outcome'"),
    "compensated": ('sum(proofline_ledger_compensations_total{result="compensated"})',
                    "SELECT count(*) AS n FROM ledger_events WHERE event = 'compensated'"),
    "actions verified": ('sum(proofline_ledger_actions{outcome="completed_verified"})',
                         "SELECT count(*) AS n FROM actions WHERE outcome = 'completed_verified'"),
}

#: Grafana's built-in variables, as a dashboard over this one-second-scrape server would set them.
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__interval_ms": "15000",
                    "__range": "1h", "__range_s": "3600", "__range_ms": "3600000"}
#: Panel queries (title [refId]) whose series the mixed batch causes no event for: no
#: irreversible action, revalidation failure, retry, escalation, partial completion, refusal,
#: re-drive, sandbox violation or failed verification; a lease conflict only when two deliveries
#: happen to meet on a target. They must evaluate, not show data.
QUIET_PANELS = {
    "Duplicates, conflicts, lease conflicts / min [C]",
    "Irreversible actions [A]", "Manual recovery rate [A]", "Partial completion rate [A]",
    "Precondition and revalidation failures / min [B]", "Reconciler: re-drives / min and seconds since last sweep [A]",
    "Refusals by reason / min [A]", "Retries by classified cause / min [A]", "Retries by classified cause / min [B]",
    "Sandbox violations and post-condition regressions / h [A]",
    "Sandbox violations and post-condition regressions / h [B]", "Verification failure rate [A]",
}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


@dataclass
class Batch:
    prometheus: PrometheusServer
    observed: Observed
    #: Each key series' value before the batch (once Prometheus agreed with the ledger).
    before: dict[str, float]
    #: The batch's action ids by case.
    actions: dict[str, str]


def ledger_counts(observed: Observed) -> dict[str, float]:
    counts = {}
    with observed.stack.conn.cursor() as cur:
        for name, (_, sql) in KEY_SERIES.items():
            cur.execute(sql)
            counts[name] = float(cur.fetchone()["n"])
    return counts


def stored(prometheus: PrometheusServer) -> dict[str, float]:
    return {name: prometheus.scalar(expr) for name, (expr, _) in KEY_SERIES.items()}


def agreeing(prometheus: PrometheusServer, observed: Observed, timeout: float = 30.0) -> dict[str, float]:
    """The key series once Prometheus's values equal the ledger's counts (follow-ups may still be
    committing, and a scrape lags a second); fails with both when they never do."""
    try:
        return wait_for(lambda: (s := stored(prometheus)) == ledger_counts(observed) and s, timeout, interval=0.5,
                        what="Prometheus's series to equal the ledger's counts")
    except AssertionError:
        raise AssertionError(f"prometheus {stored(prometheus)}\nledger {ledger_counts(observed)}") from None


@pytest.fixture(scope="module")
def prometheus(observed: Observed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    prometheus_binary()  # fails, naming the package, before anything is started
    _, exporter_port = start_exporter(observed.stack)
    config = loopback_config({WORKERS_JOB: [f"127.0.0.1:{p}" for p in observed.ports],
                              EXPORTER_JOB: [f"127.0.0.1:{exporter_port}"]})
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), config)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def batch(prometheus: PrometheusServer, observed: Observed) -> Batch:
    # Every target scraped at least once before the batch, so the rates below see it begin.
    wait_for(lambda: all(t["health"] == "up" for t in prometheus.targets()), 90, interval=0.2,
             what="every target to be up")
    before = agreeing(prometheus, observed)
    return Batch(prometheus, observed, before, mixed_batch(observed.stack))


def test_every_target_is_up_and_the_stored_series_are_the_ledgers(batch: Batch) -> None:
    prometheus, observed = batch.prometheus, batch.observed
    after = agreeing(prometheus, observed)
    # The verified actions Prometheus counted for the batch are the batch's verified actions in
    # the ledger, as the exporter reads them and as the workers counted them.
    with observed.stack.conn.cursor() as cur:
        cur.execute(VERIFIED_SQL + " AND action_id::text = ANY(%s)", (list(batch.actions.values()),))
        verified = cur.fetchone()["n"]
    assert verified >= 3
    for name in ("verified (exporter)", "verified (workers)"):
        assert after[name] - batch.before[name] == verified, (name, batch.before[name], after[name], verified)
    assert after["started (exporter)"] - batch.before["started (exporter)"] >= 4
    assert after["unknown-outcome calls"] - batch.before["unknown-outcome calls"] >= 1
    assert after["compensated"] - batch.before["compensated"] == 1
    assert prometheus.scalar("min(proofline_ledger_up)") == 1
    # Every target up: both workers and the exporter, under the compose stack's job names.
    targets = wait_for(lambda: (ts := prometheus.targets()) and all(t["health"] == "up" for t in ts) and ts, 15,
                       interval=0.2, what="every target to be up")
    assert sorted((t["labels"]["job"], t["scrapeUrl"]) for t in targets) == prometheus.configured_targets()
    assert prometheus.scalar(f'count(up{{job="{WORKERS_JOB}"}} == 1)') == len(observed.ports)


def expected_rules() -> dict[tuple[str, str], list[str]]:
    """(file, group) -> rule names, from the rule files the compose configuration loads."""
    groups = {}
    for path in rule_files(compose_config()):
        for group in yaml.safe_load(path.read_text())["groups"]:
            groups[(str(path), group["name"])] = [r.get("alert") or r.get("record") for r in group["rules"]]
    return groups


def test_every_rule_group_is_loaded_and_evaluates_without_error(batch: Batch) -> None:
    prometheus = batch.prometheus
    expected = expected_rules()
    assert expected and all(expected.values())

    def evaluated() -> list[dict[str, Any]] | None:
        groups = prometheus.rule_groups()
        rules = [r for g in groups for r in g["rules"]]
        return groups if rules and all(r["health"] != "unknown" for r in rules) else None

    groups = wait_for(evaluated, 90, interval=0.5, what="every rule to be evaluated once")
    loaded = {(g["file"], g["name"]): [r["name"] for r in g["rules"]] for g in groups}
    assert loaded == expected
    broken = {r["name"]: (r["health"], r.get("lastError")) for g in groups for r in g["rules"]
              if r["health"] != "ok" or r.get("lastError")}
    assert not broken, broken


def substituted(expr: str, board: dict[str, Any]) -> str:
    """``expr`` with Grafana's variables replaced: the built-ins by sensible windows, the
    dashboard's own variables by their current value (every value, ``.*``, for "All")."""
    values = dict(GRAFANA_BUILTINS)
    for variable in board.get("templating", {}).get("list", []):
        current = (variable.get("current") or {}).get("value")
        if current in (None, "", "$__all") or current == ["$__all"]:
            values[variable["name"]] = ".*"
        else:
            values[variable["name"]] = "|".join(current) if isinstance(current, list) else str(current)

    def one(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        assert name in values, f"dashboard variable ${name} is neither Grafana's nor the dashboard's: {expr}"
        return values[name]

    return _VARIABLE.sub(one, expr)


def test_every_dashboard_query_runs_against_the_live_series(batch: Batch) -> None:
    prometheus, board = batch.prometheus, dashboard()
    queries = {title: substituted(expr, board) for title, expr in dashboard_queries()}
    assert QUIET_PANELS <= set(queries), QUIET_PANELS - set(queries)

    def answered() -> dict[str, dict[str, Any]]:
        answers = {title: prometheus.query(expr) for title, expr in queries.items()}
        failed = {t: (a.get("errorType"), a.get("error")) for t, a in answers.items() if a["status"] != "success"}
        assert not failed, failed
        return answers

    def empty(answers: dict[str, dict[str, Any]]) -> set[str]:
        return {title for title, a in answers.items() if not a["data"]["result"]} - QUIET_PANELS

    # Every query parses and evaluates; every one whose events the batch caused shows data once
    # its rate windows hold two samples of the new series.
    try:
        wait_for(lambda: not empty(answered()), 90, interval=0.5, what="the batch's panels to show data")
    except AssertionError:
        raise AssertionError(f"no data for {sorted(empty(answered()))}") from None
