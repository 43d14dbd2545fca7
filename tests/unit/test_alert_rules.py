"""The chart's alert rules, checked and unit-tested by the real promtool (Debian package
`prometheus`; `make test` installs it). The promtool tests in tests/alerts/ make every alert
fire and stay quiet."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts" / "slipstream" / "alerts" / "rules.yaml"
PROMTOOL_TESTS = sorted((ROOT / "tests" / "alerts").glob("*_test.yaml"))
ALERTS = ("SlipstreamTTFTErrorBudgetBurnFast", "SlipstreamTTFTErrorBudgetBurnSlow",
          "SlipstreamTPOTErrorBudgetBurnFast", "SlipstreamTPOTErrorBudgetBurnSlow",
          "SlipstreamInstanceDown", "SlipstreamKVCacheSaturated", "SlipstreamQueueGrowing",
          "SlipstreamAutoscalerAtMaxInstances")


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (make test installs Debian's prometheus package)")
    return path


def test_rules_pass_promtool_check(promtool):
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_pass(promtool):
    result = subprocess.run([promtool, "test", "rules", *map(str, PROMTOOL_TESTS)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_runbook_and_is_tested_firing_and_quiet(chart_inventory):
    alerts = {rule["alert"]: rule for group in chart_inventory.rule_groups()
              for rule in group["rules"] if "alert" in rule}
    assert set(alerts) == set(ALERTS)
    tests_text = "\n".join(path.read_text() for path in PROMTOOL_TESTS)
    for name, rule in alerts.items():
        assert rule["annotations"].get("runbook", "").strip(), f"{name} has no runbook"
        assert rule["labels"]["severity"] in ("critical", "warning")
        blocks = tests_text.split(f"alertname: {name}\n")[1:]
        outcomes = {"quiet" if block.lstrip().startswith("exp_alerts: []") else "fires"
                    for block in blocks}
        assert outcomes == {"quiet", "fires"}, f"{name}: tested only as {outcomes or 'nothing'}"


def test_rules_read_only_exported_metrics(chart_inventory):
    from slipstream.contracts import metric_names

    recorded = chart_inventory.recorded_names()
    for query in chart_inventory.rule_queries():
        for name in query.names:
            known = (name in recorded or name in metric_names.PROMETHEUS_BUILTINS
                     or metric_names.family_of(name) is not None)
            assert known, f"{query.source} reads {name}, which nothing exports"
