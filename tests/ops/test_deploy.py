"""The files under deploy/: the alert rules, their unit tests, the example Prometheus
configuration and the Grafana dashboard.

- promtool accepts the rules (``check rules``), their unit tests pass (``test rules``: every
  alert has a case where it fires and one where it does not), the example configuration is
  valid (``check config``), and every dashboard query parses as PromQL. These skip, saying
  why, only where promtool is absent; where it is present, any error fails.
- Every series an alert or a panel names is one deltarl exports (deltarl.ops.metrics), so a
  renamed metric cannot silently leave a rule that never fires or a panel that stays empty.
- Every alert has a severity (page or warn), a summary, a description and a runbook link to
  its section of docs/operations.md; the dashboard parses, its panel ids are unique and
  every panel other than a row has a query.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from deltarl.ops.metrics import RUNTIME_SERIES, catalogue

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERTS_TEST = PROMETHEUS_DIR / "alerts_test.yml"
CONFIG = PROMETHEUS_DIR / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "deltarl.json"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian package prometheus; scripts/install.sh --test"
    " installs it where apt-get can)",
)

# Words of PromQL that look like identifiers but name no series. Functions need no entry:
# an identifier followed by "(" is a call and is left out (the aggregation operators too).
PROMQL_WORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"offset", "bool", "inf", "nan"}
)
SERIES_OUTSIDE_DELTARL = frozenset({"up"})  # Prometheus's own, one per target


def promtool(*args: str | Path) -> str:
    """Run promtool; its output, or a failure that shows it."""
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(map(str, args))} failed:\n{output}"
    return output


@cache
def exported_series() -> frozenset[str]:
    """Every series name a deltarl daemon can serve: the registry's families with the
    suffixes the exposition gives them, and the runtime collector's families."""
    names = set(RUNTIME_SERIES)
    for family in catalogue().collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}{s}" for s in ("_bucket", "_sum", "_count"))
        elif family.type == "summary":
            names.update(f"{family.name}{s}" for s in ("", "_sum", "_count"))
        else:
            names.add(family.name)
    return frozenset(names)


def series_names(expr: str) -> set[str]:
    """The series names a PromQL expression (or a Grafana query) selects.

    Not a parser: it removes what holds identifiers that are not series (strings, label
    matchers, ranges, Grafana variables, label lists after by/on/ignoring/group_*), then
    keeps the identifiers that are not calls or keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    expr = re.sub(r"\$\{[^}]*\}|\$\w+", "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    found = re.findall(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", expr)
    return {name for name in found if name.lower() not in PROMQL_WORDS}


def unknown_series(expr: str) -> set[str]:
    return series_names(expr) - exported_series() - SERIES_OUTSIDE_DELTARL


@cache
def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    rules = [rule for group in doc["groups"] for rule in group["rules"]]
    assert rules, f"{ALERTS} has no rules"
    return rules


@cache
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def data_panels() -> list[dict[str, Any]]:
    """Every panel but the rows, including those inside collapsed rows."""
    out = []
    for panel in dashboard()["panels"]:
        if panel.get("type") == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def all_panels() -> list[dict[str, Any]]:
    return dashboard()["panels"] + [
        inner for panel in dashboard()["panels"] for inner in panel.get("panels", [])
    ]


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target."""
    return [
        (f"panel {panel['id']} ({panel['title']}) target {target['refId']}", target["expr"])
        for panel in data_panels()
        for target in panel.get("targets", [])
    ]


# -- promtool ----------------------------------------------------------------------------------


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    output = promtool("check", "rules", ALERTS)
    assert f"SUCCESS: {len(alert_rules())} rules found" in output, output


@needs_promtool
def test_the_rules_unit_tests_pass() -> None:
    output = promtool("test", "rules", ALERTS_TEST)
    assert "SUCCESS" in output, output


@needs_promtool
def test_the_example_config_is_valid(tmp_path: Path) -> None:
    # A copy, with the rules beside it, so the relative rule_files path resolves as it does
    # for an operator who copies the two files together.
    shutil.copy(CONFIG, tmp_path / CONFIG.name)
    shutil.copy(ALERTS, tmp_path / ALERTS.name)
    output = promtool("check", "config", tmp_path / CONFIG.name)
    assert "1 rule files found" in output, output
    assert f"SUCCESS: {len(alert_rules())} rules found" in output, output


@needs_promtool
def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    """Each query as a recording rule, with Grafana's variables given values, through
    ``promtool check rules`` (which parses every expression)."""
    rules = [
        {
            "record": f"deltarl:dashboard:query_{i}",
            "expr": expr.replace("$__rate_interval", "5m").replace("$job", ".+"),
        }
        for i, (_, expr) in enumerate(dashboard_queries())
    ]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    output = promtool("check", "rules", path)
    assert f"SUCCESS: {len(rules)} rules found" in output, output


# -- the series named are deltarl's ------------------------------------------------------------


def test_series_names_finds_selectors_not_labels_or_functions() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (job, le) (rate(deltarl_reward_seconds_bucket{job=~"$job",'
        ' le!="x"}[$__rate_interval]))) > 2 * on(job, instance) group_left(daemon)'
        " deltarl_daemon_info and deltarl_skewness offset 30m unless up"
    )
    assert series_names(expr) == {
        "deltarl_reward_seconds_bucket",
        "deltarl_daemon_info",
        "deltarl_skewness",
        "up",
    }
    assert unknown_series("rate(deltarl_nope_total[5m]) / deltarl_steps") == {
        "deltarl_nope_total",
        "deltarl_steps",  # a counter's family name without _total is not a series
    }


def test_exported_series_includes_suffixes_and_runtime_families() -> None:
    names = exported_series()
    assert {
        "deltarl_checksum_failures_total",
        "deltarl_refit_stage_seconds_bucket",
        "deltarl_refit_stage_seconds_count",
        "deltarl_process_open_fds",
        "deltarl_daemon_start_time_seconds",
    } <= names
    assert "deltarl_checksum_failures" not in names


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_names_only_exported_series(rule: dict[str, Any]) -> None:
    names = series_names(rule["expr"])
    assert names, f"{rule['alert']}: no series found in {rule['expr']!r}"
    assert not unknown_series(rule["expr"]), (
        f"{rule['alert']} names series deltarl does not export: "
        f"{sorted(unknown_series(rule['expr']))}"
    )


def test_dashboard_queries_name_only_exported_series() -> None:
    queries = dashboard_queries()
    assert queries
    bad = {}
    for where, expr in queries:
        assert series_names(expr), f"{where}: no series found in {expr!r}"
        if unknown := unknown_series(expr):
            bad[where] = sorted(unknown)
    for variable in dashboard()["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else ""
        for metric in re.findall(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*,", text):
            if metric not in exported_series():
                bad[f"variable {variable['name']}"] = [metric]
    assert not bad, f"dashboard queries name series deltarl does not export: {bad}"


# -- the rules' labels and annotations ---------------------------------------------------------


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_has_severity_and_annotations(rule: dict[str, Any]) -> None:
    name = rule["alert"]
    assert rule.get("labels", {}).get("severity") in {"page", "warn"}, name
    annotations = rule.get("annotations", {})
    for key in ("summary", "description", "runbook"):
        assert str(annotations.get(key, "")).strip(), f"{name}: no {key}"
    assert annotations["runbook"] == f"docs/operations.md#alert-{name.lower()}", name


def test_alert_names_are_unique() -> None:
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names)), names
    assert all("record" not in rule for rule in alert_rules())


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    doc = yaml.safe_load(ALERTS_TEST.read_text())
    assert doc["rule_files"] == [ALERTS.name]
    fires, quiet = set(), set()
    for group in doc["tests"]:
        for case in group.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert names - fires == set(), "alerts with no unit test where they fire"
    assert names - quiet == set(), "alerts with no unit test where they do not fire"
    assert (fires | quiet) - names == set(), "unit tests of alerts that do not exist"


def test_the_example_config_loads_the_rules_and_scrapes_the_deltarl_job() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    assert config["rule_files"] == [ALERTS.name]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = [t for sc in jobs["deltarl"]["static_configs"] for t in sc["targets"]]
    assert targets
    assert all(t.startswith("127.0.0.1:") for t in targets)
    assert len(set(targets)) == len(targets)
    # The target's own labels win: a daemon cannot relabel its series as another target.
    assert "honor_labels" not in jobs["deltarl"]


# -- the dashboard -----------------------------------------------------------------------------


def test_dashboard_panels_have_unique_ids_and_queries() -> None:
    board = dashboard()
    assert 36 <= board["schemaVersion"] <= 41
    ids = [panel["id"] for panel in all_panels()]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    for panel in data_panels():
        targets = panel.get("targets", [])
        assert targets, f"panel {panel['id']} ({panel.get('title')}) has no query"
        assert all(str(t.get("expr", "")).strip() for t in targets), panel["id"]
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), panel["id"]


def test_dashboard_uses_the_datasource_variable() -> None:
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    want = {"type": "prometheus", "uid": "${datasource}"}
    for panel in data_panels():
        assert panel["datasource"] == want, panel["id"]
        for target in panel["targets"]:
            assert target.get("datasource", want) == want, (panel["id"], target["refId"])


def test_dashboard_has_the_rows() -> None:
    rows = {panel["title"] for panel in dashboard()["panels"] if panel.get("type") == "row"}
    assert {"Refit", "Bubbles", "Policy lag", "Learning", "Daemon health"} <= rows
