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
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from slipstream.agent.server import metric_names

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "charts"))
from dashgen import inventory  # noqa: E402  (dashgen lives beside the chart)

LONG_THRESHOLD_TOKENS = 48
SCRAPE_INTERVAL = "1s"
PROMETHEUS_START_TIMEOUT_S = 30.0
DASHBOARD_QUERIES = inventory.dashboard_queries()
# The predictor fills Batch.predicted_time_s once the time-budget packer runs in the engine;
# until then those panels return NaN (still data), so only finiteness is waived for them.
MAY_BE_NAN = {metric_names.BATCH_TIME_PREDICTED.name}


def _is_operator_query(query: inventory.Query) -> bool:
    """Operator and router series come from other processes than the agent scraped here."""
    return any(name.startswith(("slipstream_operator_", "slipstream_router_"))
               for name in query.names)


@pytest.fixture(scope="module")
def observed_server(start_server):
    return start_server("--slo-ttft-seconds", "2", "--slo-tpot-ms", "500",
                        "--slo-attainment-target", "0.95",
                        "--long-prompt-threshold-tokens", str(LONG_THRESHOLD_TOKENS))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Prometheus:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def query(self, promql: str) -> list[dict]:
        response = httpx.get(f"{self.base_url}/api/v1/query", params={"query": promql},
                             timeout=10)
        body = response.json()
        assert body["status"] == "success", f"{promql}: {body}"
        return body["data"]["result"]

    def wait_for(self, promql: str, timeout_s: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while not (result := self.query(promql)) and time.monotonic() < deadline:
            time.sleep(0.25)
        return result


@pytest.fixture(scope="module")
def prometheus(observed_server, tmp_path_factory):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (make test installs Debian's prometheus package)")
    workdir = tmp_path_factory.mktemp("prometheus")
    # The chart's rules, evaluated every second instead of every minute, so that recording
    # rules have values within the test.
    rules = inventory.rule_groups()
    for group in rules:
        group["interval"] = SCRAPE_INTERVAL
    (workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": rules}))
    agent = observed_server.base_url.removeprefix("http://")
    config = {"global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": "1s"},
              "rule_files": [str(workdir / "rules.yaml")],
              "scrape_configs": [{"job_name": "slipstream-agent",
                                  "static_configs": [{"targets": [agent]}]}]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    with open(workdir / "prometheus.log", "wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    server = Prometheus(f"http://127.0.0.1:{port}")
    try:
        _wait_ready(server, process, workdir / "prometheus.log")
        assert server.wait_for('up{job="slipstream-agent"} == 1'), "agent never scraped"
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(server: Prometheus, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + PROMETHEUS_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{server.base_url}/-/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"prometheus did not become ready:\n{log_path.read_text()}")


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
    if _is_operator_query(query):
        pytest.skip("operator or router metric: not exported by the agent under test")
    result = loaded.query(query.promql)
    assert result, f"{query.source} returned no data:\n{query.promql}"
    may_be_nan = any(metric_names.family_of(name).name in MAY_BE_NAN for name in query.names
                     if metric_names.family_of(name) is not None)
    if not may_be_nan:
        values = [float(series["value"][1]) for series in result]
        assert any(math.isfinite(value) for value in values), \
            f"{query.source} returned only NaN:\n{query.promql}"
