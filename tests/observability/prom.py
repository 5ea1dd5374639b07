"""Prometheus for the tests: Debian's ``prometheus`` and ``promtool`` binaries, the shipped rules
and dashboards under deploy/observability/, and the queries in them.

``Prometheus`` runs the real server on loopback with its TSDB in a temporary directory, a
generated configuration (scrape and evaluate every second) and a test copy of the rules in
which every ``for:`` is rewritten to ``1s`` (the shipped rules wait minutes); nothing else
in the copy changes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.faults.harness import wait_http
from tests.support.ports import free_port
from tests.support.process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "deploy" / "observability"
RULES_DIR = OBSERVABILITY / "prometheus" / "rules"
RULE_TESTS_DIR = OBSERVABILITY / "prometheus" / "tests"
DASHBOARDS_DIR = OBSERVABILITY / "grafana"
TEST_FOR = "1s"
# What Grafana puts in place of its interval variables, for running a panel's query here:
# the test's Prometheus scrapes every second, so 30 s holds 30 samples.
GRAFANA_INTERVALS = {"$__rate_interval": "30s", "$__interval": "5s", "$__range": "5m"}
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"no {name} on PATH: `make test-observability` installs Debian's prometheus")
    return found


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args], capture_output=True, text=True, check=False, cwd=cwd
    )


def rule_files() -> list[Path]:
    return sorted(RULES_DIR.glob("*.yml"))


def rules() -> list[dict[str, Any]]:
    """Every rule of every shipped rule file."""
    out: list[dict[str, Any]] = []
    for path in rule_files():
        for group in yaml.safe_load(path.read_text())["groups"]:
            out.extend(group["rules"])
    return out


def alerts() -> list[dict[str, Any]]:
    return [r for r in rules() if "alert" in r]


def recordings() -> list[dict[str, Any]]:
    return [r for r in rules() if "record" in r]


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS_DIR.glob("*.json"))}


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included; rows themselves are not panels."""
    for panel in board["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


@dataclass(frozen=True, slots=True)
class Query:
    where: str  # dashboard file, panel title, refId
    expr: str  # as the dashboard spells it


def panel_queries() -> list[Query]:
    return [
        Query(f"{name}: {panel['title']} ({target['refId']})", target["expr"])
        for name, board in dashboards().items()
        for panel in panels(board)
        for target in panel["targets"]
    ]


def substitute(expr: str, variables: dict[str, str]) -> str:
    """A panel's query as Grafana sends it: its interval variables and the dashboard's own
    (``$region`` or ``${region}``) replaced."""
    for name, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(name, value)
    for name, value in variables.items():
        expr = re.sub(rf"\$(?:\{{{name}\}}|{name}\b)", value, expr)
    assert "$" not in expr, f"a variable left in {expr!r}"
    return expr


def rules_for_tests(into: Path) -> Path:
    """The shipped rules with every ``for:`` rewritten to :data:`TEST_FOR`, in ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    for path in rule_files():
        data = yaml.safe_load(path.read_text())
        for group in data["groups"]:
            for rule in group["rules"]:
                if "for" in rule:
                    rule["for"] = TEST_FOR
        (into / path.name).write_text(yaml.safe_dump(data, sort_keys=False))
    return into


class Prometheus:
    """The real server, scraping ``scrape_configs`` every second and evaluating the test copy of
    the rules every second."""

    def __init__(self, work: Path, scrape_configs: list[dict[str, Any]]) -> None:
        self.work = work
        self.port = free_port()
        rules_dir = rules_for_tests(work / "rules")
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(rules_dir / "*.yml")],
            "scrape_configs": scrape_configs,
        }  # fmt: skip
        self.config = work / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        checked = promtool("check", "config", str(self.config))
        assert checked.returncode == 0, checked.stdout + checked.stderr
        argv = [
            binary("prometheus"),
            f"--config.file={self.config}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.process = ServerProcess(argv, log_path=work / "prometheus.log")
        wait_http(f"{self.url}/-/ready", what="prometheus", process=self.process)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``'s ``data``; fails on an error answer (a query that does not
        parse is a 400 with the parser's message)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with _HTTP.open(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read())
            raise AssertionError(f"{path} {params}: {body.get('error')}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (a vector, or a scalar as one sample)."""
        data = self.api("query", query=expr)
        result = data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        assert data["resultType"] == "vector", data
        return list(result)

    def query_range(self, expr: str, seconds: float) -> list[dict[str, Any]]:
        end = time.time()
        data = self.api(
            "query_range", query=expr, start=f"{end - seconds:.3f}", end=f"{end:.3f}", step="1"
        )
        return list(data["result"])

    def alerts(self, name: str, state: str = "firing") -> list[dict[str, str]]:
        """The labels of every ``name`` alert in ``state`` (``pending``, ``firing``)."""
        return [
            a["labels"]
            for a in self.api("alerts")["alerts"]
            if a["labels"]["alertname"] == name and a["state"] == state
        ]

    def stop(self) -> None:
        self.process.stop()
