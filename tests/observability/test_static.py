"""The shipped rules and dashboards without a fleet: ``promtool check`` and ``promtool test
rules`` (deploy/observability/prometheus/tests/: every alert firing and not firing), every
dashboard query parsed by promtool, every series named documented, every alert documented
with a runbook that exists."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.observability.prom import (
    DASHBOARDS_DIR,
    OBSERVABILITY,
    ROOT,
    RULE_TESTS_DIR,
    alerts,
    dashboards,
    panel_queries,
    panels,
    promtool,
    recordings,
    rule_files,
    rules,
    substitute,
)
from tests.support.metrics import REFERENCE, documented

pytestmark = pytest.mark.observability

RUNBOOK_BASE = "https://meridian.example/docs/runbooks/"
RUNBOOKS = ROOT / "docs" / "runbooks"
SEVERITIES = {"page", "ticket"}
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# Series from outside Meridian the rules and dashboards read: Prometheus' own, and the vLLM
# nodes' prefix-cache counters (meridian-sim exports them as vLLM >= 0.10 does).
EXTERNAL = {"up", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"}
_NAME = re.compile(r"(?<![\w:\"])((?:meridian_|vllm:|region:)[A-Za-z0-9_:]+|up)\b(?!\s*\()")


# -- promtool ------------------------------------------------------------------------------------


def test_promtool_checks_the_rules() -> None:
    files = [str(p) for p in rule_files()]
    assert files, "no rule file under deploy/observability/prometheus/rules"
    checked = promtool("check", "rules", *files)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout


def test_promtool_checks_the_example_config() -> None:
    checked = promtool("check", "config", str(OBSERVABILITY / "prometheus" / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_promtool_unit_tests_pass() -> None:
    files = sorted(str(p.relative_to(RULE_TESTS_DIR)) for p in RULE_TESTS_DIR.glob("*.yml"))
    assert files
    ran = promtool("test", "rules", *files, cwd=RULE_TESTS_DIR)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.count("SUCCESS") == len(files), ran.stdout


def _unit_tests() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(RULE_TESTS_DIR.glob("*.yml")):
        out.extend(yaml.safe_load(path.read_text())["tests"])
    return out


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in _unit_tests():
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names - firing == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested not firing"
    assert (firing | quiet) <= names, "tests of alerts that do not exist"


def test_every_recording_rule_is_unit_tested() -> None:
    exprs = " ".join(
        check["expr"] for case in _unit_tests() for check in case.get("promql_expr_test", [])
    )
    for rule in recordings():
        assert rule["record"] in exprs, rule["record"]


# -- the rules' shape ----------------------------------------------------------------------------


def test_every_alert_has_a_severity_a_summary_a_description_and_a_runbook() -> None:
    for alert in alerts():
        name = alert["alert"]
        assert alert["labels"]["severity"] in SEVERITIES, name
        notes = alert["annotations"]
        assert set(notes) == {"summary", "description", "runbook_url"}, name
        assert notes["summary"].strip() and notes["description"].strip(), name
        url = notes["runbook_url"]
        assert url.startswith(RUNBOOK_BASE), (name, url)
        page = RUNBOOKS / url.removeprefix(RUNBOOK_BASE)
        assert page.is_file(), f"{name}: {page} does not exist"


def test_every_alert_is_in_the_docs_table_with_its_severity_and_runbook() -> None:
    text = REFERENCE.read_text()
    for alert in alerts():
        name = alert["alert"]
        rows = [line for line in text.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(rows) == 1, f"{name}: {len(rows)} rows in docs/observability.md"
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        assert cells[2] == alert["labels"]["severity"], (name, cells)
        page = alert["annotations"]["runbook_url"].removeprefix(RUNBOOK_BASE)
        assert f"(runbooks/{page})" in cells[3], (name, cells)


# -- the dashboards ------------------------------------------------------------------------------


def test_the_dashboards_are_grafana_json_on_a_prometheus_variable() -> None:
    boards = dashboards()
    assert set(boards) == {"fleet-overview.json", "region.json", "controller-health.json"}
    assert len({b["uid"] for b in boards.values()}) == len(boards)
    for name, board in boards.items():
        assert 36 <= board["schemaVersion"] <= 41, name
        assert board["title"].startswith("Meridian / ") and "meridian" in board["tags"], name
        variables = {v["name"]: v for v in board["templating"]["list"]}
        ds = variables["DS_PROMETHEUS"]
        assert ds["type"] == "datasource" and ds["query"] == "prometheus", name
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), name
        for panel in panels(board):
            where = f"{name}: {panel['title']}"
            assert panel["datasource"] == DS, where
            assert panel["targets"], where
            assert panel.get("description"), where
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, where
            for target in panel["targets"]:
                assert target["datasource"] == DS, where
                assert target["expr"].strip(), where
    region = {v["name"]: v for v in boards["region.json"]["templating"]["list"]}["region"]
    assert region["type"] == "query" and region["datasource"] == DS
    assert region["query"]["query"] == "label_values(meridian_agent_build_info, region)"


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    """Each panel's query (Grafana's variables substituted) as a recording rule, for
    ``promtool check rules`` to parse."""
    queries = panel_queries()
    assert len(queries) >= 40
    group = {
        "name": "dashboard-queries",
        "rules": [
            {"record": f"dashboard:query_{i}", "expr": substitute(q.expr, {"region": "eu-west"})}
            for i, q in enumerate(queries)
        ],
    }
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [group]}))
    checked = promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _series_named(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values and strings name no series
    return set(_NAME.findall(expr))


def _known_series() -> set[str]:
    known = set(EXTERNAL) | {r["record"] for r in recordings()}
    for prefix in ("meridian_controller_", "meridian_agent_"):
        for name, (kind, _) in documented(prefix).items():
            known |= {f"{name}{s}" for s in ("_bucket", "_count", "_sum")} if kind == "histogram" \
                else {name}  # fmt: skip
    return known


def test_the_dashboards_and_rules_read_only_series_that_exist() -> None:
    """Every series named is in docs/observability.md's reference (which the metric tests check
    against what the processes export), a recording rule of ours, or one of :data:`EXTERNAL`."""
    known = _known_series()
    used: dict[str, set[str]] = {}
    for q in panel_queries():
        used[q.where] = _series_named(q.expr)
    for rule in rules():
        used[rule.get("alert") or rule["record"]] = _series_named(rule["expr"])
    for board in dashboards().values():
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                used[variable["name"]] = _series_named(variable["query"]["query"])
    unknown = {where: names - known for where, names in used.items() if names - known}
    assert unknown == {}
    assert all(used.values()), [w for w, n in used.items() if not n]


def test_the_series_check_would_see_a_misspelt_name() -> None:
    """The check above is only as good as its extraction: names in selectors, ranges, joins."""
    expr = (
        'sum by (node) (rate(meridian_agent_requests_totl{status=~"5.."}[5m])'
        ' * on (instance, job) group_left (region) meridian_agent_build_info{region="eu-west"})'
    )
    assert _series_named(expr) == {"meridian_agent_requests_totl", "meridian_agent_build_info"}
    assert _series_named(expr) - _known_series() == {"meridian_agent_requests_totl"}
    assert _series_named("histogram_quantile(0.5, sum by (le) (rate(vllm:x_bucket[1m])))") == {
        "vllm:x_bucket"
    }


def test_the_dashboards_dir_holds_only_dashboards() -> None:
    assert sorted(p.suffix for p in DASHBOARDS_DIR.iterdir()) == [".json"] * 3
