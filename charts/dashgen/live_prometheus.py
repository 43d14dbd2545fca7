"""A real Prometheus server for the live checks of the shipped dashboards and rules.

    static targets (loopback host:port) + alerts/rules.yaml --> Debian's `prometheus` binary
      --> /api/v1/query --> missing_data(query): why a dashboard query shows nothing, or None

Shared by ``tests/server/test_observability_live.py`` (one agent) and
``e2e/test_observability_e2e.py`` (agents, operator and router on the local cluster). The rules
are evaluated every second instead of every minute, so recording rules have values within a
test. The server is stopped by its pid.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from dashgen import inventory
from slipstream.bench import local_process
from slipstream.agent.parallel.launch import free_port
from slipstream.contracts import metric_names

SCRAPE_INTERVAL = "1s"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0
# The predictor fills Batch.predicted_time_s once the time-budget packer runs in the engine;
# until then those panels return NaN (still data), so only finiteness is waived for them.
MAY_BE_NAN = frozenset({metric_names.BATCH_TIME_PREDICTED.name})


def binary() -> str | None:
    return shutil.which("prometheus")



class PrometheusServer:
    """One `prometheus` process scraping fixed targets, per job, with the chart's rules."""

    def __init__(self, workdir: Path, targets_by_job: dict[str, list[str]]) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        self._write_config(targets_by_job)
        self.process: subprocess.Popen | None = None

    def _write_config(self, targets_by_job: dict[str, list[str]]) -> None:
        rules = inventory.rule_groups()
        for group in rules:
            group["interval"] = SCRAPE_INTERVAL
        (self.workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": rules}))
        config = {"global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": "1s"},
                  "rule_files": [str(self.workdir / "rules.yaml")],
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                                     for job, targets in targets_by_job.items()]}
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config))

    def start(self, executable: str) -> None:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [executable, f"--config.file={self.workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        local_process.wait_ready(f"{self.base_url}/-/ready", self.process, self.log_path,
                                 START_TIMEOUT_S)

    def stop(self) -> None:
        if self.process is not None:
            local_process.stop(self.process, STOP_TIMEOUT_S)

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


def may_be_nan(query: inventory.Query) -> bool:
    families = (metric_names.family_of(name) for name in query.names)
    return any(family is not None and family.name in MAY_BE_NAN for family in families)


def missing_data(server: PrometheusServer, query: inventory.Query) -> str | None:
    """Why the panel behind ``query`` would be empty (no series, or only NaN); None if it
    shows data."""
    result = server.query(query.promql)
    if not result:
        return f"{query.source} returned no data:\n{query.promql}"
    if may_be_nan(query):
        return None
    values = [float(series["value"][1]) for series in result]
    if not any(math.isfinite(value) for value in values):
        return f"{query.source} returned only NaN:\n{query.promql}"
    return None


def is_from(query: inventory.Query, prefix: str) -> bool:
    """Whether the query reads a series of one process kind (``slipstream_operator_``...)."""
    return any(name.startswith(prefix) for name in query.names)
