"""Observability against live processes: a real ``slipstream serve`` under a short load, its
``/metrics`` linted by ``promtool check metrics``, and a real Prometheus server (Debian's
``prometheus`` binary) scraping it on loopback with the chart's alert rules loaded. Every
dashboard query about the agent must return data from that Prometheus.

Both binaries come from Debian's ``prometheus`` package (``make test`` installs it); without
them these tests skip.
"""

from __future__ import annotations

import concurrent.futures
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream.contracts import metric_names

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "charts"))
from dashgen import inventory, live_prometheus  # noqa: E402  (dashgen lives beside the chart)

LONG_THRESHOLD_TOKENS = 48
DASHBOARD_QUERIES = inventory.dashboard_queries()
OTHER_PROCESSES = ("slipstream_operator_", "slipstream_router_")


@pytest.fixture(scope="module")
def observed_server(start_server):
    return start_server("--slo-ttft-seconds", "2", "--slo-tpot-ms", "500",
                        "--slo-attainment-target", "0.95",
                        "--long-prompt-threshold-tokens", str(LONG_THRESHOLD_TOKENS))


@pytest.fixture(scope="module")
def prometheus(observed_server, tmp_path_factory):
    binary = live_prometheus.binary()
    if binary is None:
        pytest.skip("prometheus not installed (make test installs Debian's prometheus package)")
    agent = observed_server.base_url.removeprefix("http://")
    server = live_prometheus.PrometheusServer(tmp_path_factory.mktemp("prometheus"),
                                              {"slipstream-agent": [agent]})
    try:
        server.start(binary)
        assert server.wait_for('up{job="slipstream-agent"} == 1'), "agent never scraped"
        yield server
    finally:
        server.stop()


def _load(server) -> None:
    """Short and long prompts, streamed and not, a few at a time."""
    client = server.openai_client(timeout=120)
    long_prompt = " ".join(f"word{i}" for i in range(LONG_THRESHOLD_TOKENS * 2))

    def one(index: int) -> int:
        prompt = long_prompt if index % 3 == 0 else f"hello number {index}"
        if index % 2:
            stream = client.completions.create(model=server.model, prompt=prompt, max_tokens=8,
                                               stream=True)
            return sum(1 for _ in stream)
        result = client.completions.create(model=server.model, prompt=prompt, max_tokens=8)
        return result.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        assert all(count > 0 for count in pool.map(one, range(12)))


@pytest.fixture(scope="module")
def loaded(observed_server, prometheus):
    """Load once, then let Prometheus scrape the after-state a few times."""
    _load(observed_server)
    time.sleep(3)
    assert prometheus.wait_for('slipstream_slo_requests_total{slo="ttft"} > 0')
    return prometheus


def test_metrics_endpoint_passes_promtool_lint(observed_server, loaded):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    text = httpx.get(f"{observed_server.base_url}/metrics", timeout=10).text
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_metrics_endpoint_exports_exactly_the_registry(observed_server, loaded):
    text = httpx.get(f"{observed_server.base_url}/metrics", timeout=10).text
    exported = {family.name: family for family in text_string_to_metric_families(text)}
    assert set(exported) == {spec.constructor_name for spec in metric_names.AGENT_METRICS}
    for spec in metric_names.AGENT_METRICS:
        family = exported[spec.constructor_name]
        assert family.type == spec.type, spec.name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == set(spec.labels), (spec.name, sample.labels)


def test_recording_rules_evaluate_against_the_agent(loaded):
    for name in ("slipstream:slo_ttft_error_ratio:rate5m", "slipstream:slo_tpot_error_ratio:rate5m",
                 "slipstream:slo_error_budget:ratio"):
        result = loaded.wait_for(name, timeout_s=10)
        assert result, f"{name} has no value"
        assert all(math.isfinite(float(series["value"][1])) for series in result), name
    (budget,) = loaded.query("slipstream:slo_error_budget:ratio")
    assert float(budget["value"][1]) == pytest.approx(0.05)


@pytest.mark.parametrize("query", DASHBOARD_QUERIES, ids=[q.source for q in DASHBOARD_QUERIES])
def test_dashboard_query_returns_data(loaded, query):
    if any(live_prometheus.is_from(query, prefix) for prefix in OTHER_PROCESSES):
        pytest.skip("operator or router metric: not exported by the agent under test "
                    "(checked in e2e/test_observability_e2e.py)")
    problem = live_prometheus.missing_data(loaded, query)
    assert problem is None, problem
