"""Reads the shipped artifacts back (dashboard JSON, alert rules) for the checks in tests/:
every PromQL expression, with Grafana's variables replaced by concrete values, and the metric
names each one reads.

    dashboards/*.json, alerts/rules.yaml -> expressions() -> promtool / Prometheus / names
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

CHART_DIR = Path(__file__).resolve().parent.parent / "slipstream"
DASHBOARD_DIR = CHART_DIR / "dashboards"
RULES_PATH = CHART_DIR / "alerts" / "rules.yaml"

# What Grafana would put in: all values of a variable, and windows that suit a short test
# (a 1 s scrape interval gives several samples per minute).
GRAFANA_SUBSTITUTIONS = {
    "$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m",
    "$job": ".*", "$pool": ".*", "$instance": ".*",
}
_KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                       "group_right", "bool", "offset", "inf", "nan", "atan2"})
_IDENTIFIER = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


@dataclass(frozen=True)
class Query:
    source: str  # "dashboard <uid> / <panel title>" or "rule <name>"
    expr: str  # as written
    promql: str  # with Grafana variables replaced

    @property
    def names(self) -> frozenset[str]:
        return metric_names(self.promql)


def to_promql(expr: str) -> str:
    for variable, value in sorted(GRAFANA_SUBSTITUTIONS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def metric_names(promql: str) -> frozenset[str]:
    """Metric and recording-rule names an expression selects (not functions, labels, keywords)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', promql)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery windows
    text = re.sub(r"\boffset\s+\w+", " ", text)
    text = _GROUPING.sub(" ", text)
    return frozenset(name for name in _IDENTIFIER.findall(text)
                     if name.lower() not in _KEYWORDS and not re.fullmatch(r"[\d.e+-]+", name))


def dashboards(directory: Path = DASHBOARD_DIR) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))}


def dashboard_queries(directory: Path = DASHBOARD_DIR) -> list[Query]:
    queries = []
    for uid, board in dashboards(directory).items():
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                queries.append(Query(f"dashboard {uid} / {panel['title']} / {target['refId']}",
                                     target["expr"], to_promql(target["expr"])))
    return queries


def variable_queries(directory: Path = DASHBOARD_DIR) -> list[tuple[str, str, str]]:
    """(metric selector, label) of every ``label_values(selector, label)`` variable."""
    found = []
    for uid, board in dashboards(directory).items():
        for variable in board["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", variable["definition"])
            assert match, f"{uid}: variable {variable['name']} is not label_values(...)"
            found.append((uid, to_promql(match.group(1)), match.group(2)))
    return found


def rule_groups(path: Path = RULES_PATH) -> list[dict]:
    return yaml.safe_load(path.read_text())["groups"]


def rule_queries(path: Path = RULES_PATH) -> list[Query]:
    return [Query(f"rule {rule.get('record') or rule.get('alert')}", rule["expr"], rule["expr"])
            for group in rule_groups(path) for rule in group["rules"]]


def recorded_names(path: Path = RULES_PATH) -> frozenset[str]:
    return frozenset(rule["record"] for group in rule_groups(path) for rule in group["rules"]
                     if "record" in rule)
