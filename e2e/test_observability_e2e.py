"""Every dashboard panel shows data on a real deployment: the chart's operator runs a
ServingReplica of 2 tiny instances in two prefill pools, `slipstream router` routes to them,
and a real Prometheus (Debian's ``prometheus`` binary, with the chart's alert rules) scrapes
the agents, the operator and the router on their loopback pod addresses.

    apply ServingReplica (pools short=1 long=1, rebalancing on) --> operator --> 2 agent pods
    slipstream router (local process, watches the pods) <-- openai client load
    prometheus <--scrape-- agents :8000, operator :8080, router
      --> every dashboard query returns data (agent, pool, operator and router panels)

The load has two parts: short prompts straight at the short pool's instance until the
rebalancer moves the idle long instance into the short pool (so that the rebalance-move panel
has a series), then short and long prompts through the router, streamed and not. Pods are on
loopback, so the scrape targets come from the pod list, not from Kubernetes service discovery.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from operator_env import (
    AUTOSCALING_SERIES, OPERATOR_METRICS_PORT, POOL_LABEL, REPO, client_for, events,
    get_replica, operator_pods, pod_ip, prometheus_scraping, replica_pods, router_process,
    servingreplica, timed, wait_ready)

sys.path.insert(0, str(REPO / "charts"))
from dashgen import inventory, live_prometheus  # noqa: E402  (dashgen lives beside the chart)

pytestmark = pytest.mark.e2e

REPLICA = "obs"
LONG_THRESHOLD_TOKENS = 48
LONG_PROMPT = " ".join(f"word{i}" for i in range(LONG_THRESHOLD_TOKENS * 2))
AGENT_PORT = 8000
MOVE_TIMEOUT_S = 45.0
DASHBOARD_QUERIES = inventory.dashboard_queries()


def observed_replica(namespace: str, model_dir: Path) -> dict:
    # A TTFT objective the CPU tiny model misses under load: the SLO deviation of the loaded
    # short pool is what makes the rebalancer move the idle long instance (minPerPool 0).
    return servingreplica(
        REPLICA, namespace, model_dir, instances=2,
        pools={"short": 1, "longPrefillThresholdTokens": LONG_THRESHOLD_TOKENS,
               "rebalance": {"enabled": True, "periodSeconds": 1, "cooldownSeconds": 300,
                             "hysteresis": 0.2, "minPerPool": 0}},
        slo={"ttftSeconds": 0.001, "tpotMilliseconds": 500, "attainmentTarget": 0.95})


def router_sees(router: str) -> int:
    try:
        return len(httpx.get(f"http://{router}/router/instances", timeout=2).json()["instances"])
    except (httpx.TransportError, ValueError):
        return 0


def short_load_until_moved(dev_cluster, namespace: str) -> list[dict]:
    """Closed-loop short prompts straight at the short pool's instance (what its pool Service
    would route to), so that requests queue in its scheduler, until a PoolRebalanced event."""
    (short_pod,) = [p for p in replica_pods(dev_cluster, namespace, REPLICA)
                    if p["metadata"]["labels"].get(POOL_LABEL) == "short"]
    client = client_for(short_pod)
    stop, errors = threading.Event(), []

    def worker() -> None:
        while not stop.is_set():
            try:
                client.completions.create(model="tiny", prompt="short chat " * 8, max_tokens=4)
            except Exception as error:  # noqa: BLE001 - recorded, asserted on
                errors.append(repr(error))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        moves = dev_cluster.wait_for(lambda: events(dev_cluster, namespace, "PoolRebalanced"),
                                     MOVE_TIMEOUT_S, "the rebalancer to move an instance",
                                     period_s=1.0)
    except AssertionError as error:
        status = (get_replica(dev_cluster, namespace, REPLICA) or {}).get("status")
        raise AssertionError(f"{error}; replica status: {status}") from None
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert errors == []
    return moves


def mixed_load(client: openai.OpenAI) -> None:
    """Short and long prompts, streamed and not, a few at a time."""
    def one(index: int) -> int:
        prompt = LONG_PROMPT if index % 3 == 0 else f"hello number {index}"
        if index % 2:
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                               stream=True)
            return sum(1 for _ in stream)
        return client.completions.create(model="tiny", prompt=prompt,
                                         max_tokens=8).usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        assert all(count > 0 for count in pool.map(one, range(12)))


def test_every_dashboard_panel_has_data(dev_cluster, operator_release, sr_namespace,
                                        tiny_model_dir, tmp_path):
    namespace = sr_namespace
    with timed("apply -> Ready, 2 tiny instances in two pools"):
        dev_cluster.apply(observed_replica(namespace, tiny_model_dir))
        wait_ready(dev_cluster, namespace, REPLICA, "2/2")
    agents = [f"{pod_ip(pod)}:{AGENT_PORT}" for pod in replica_pods(dev_cluster, namespace,
                                                                     REPLICA)]
    operator = f"{pod_ip(operator_pods(dev_cluster, operator_release, ready=True)[0])}:" \
               f"{OPERATOR_METRICS_PORT}"
    # One request per instance: the mixed load's 4 clients on 2 instances queue, so the
    # fair-queue wait panel has observations (it counts requests that waited).
    with router_process(dev_cluster, namespace, REPLICA, tmp_path / "router.log",
                        "--long-prefill-threshold-tokens", str(LONG_THRESHOLD_TOKENS),
                        "--max-in-flight-per-instance", "1") as router:
        dev_cluster.wait_for(lambda: router_sees(router) == len(agents), 60,
                             "the router to see every agent")
        targets = {"slipstream-agent": agents, "slipstream-operator": [operator],
                   "slipstream-router": [router]}
        assert all(t.startswith("127.") for job in targets.values() for t in job), targets
        with prometheus_scraping(tmp_path / "prometheus", targets) as prometheus, \
                timed("load, scrape and check every dashboard query"):
            client = openai.OpenAI(base_url=f"http://{router}/v1", api_key="unused",
                                   max_retries=0, timeout=60)
            moves = short_load_until_moved(dev_cluster, namespace)
            assert "from the long pool to the short pool" in moves[0]["message"]
            mixed_load(client)
            time.sleep(3)  # a few scrapes of the after-state
            assert prometheus.wait_for('slipstream_slo_requests_total{slo="ttft"} > 0')
            assert prometheus.wait_for("slipstream_operator_rebalance_moves_total > 0")
            checked = [query for query in DASHBOARD_QUERIES
                       if not AUTOSCALING_SERIES.search(query.promql)]
            assert len(checked) < len(DASHBOARD_QUERIES)
            problems = [problem for query in checked
                        if (problem := live_prometheus.missing_data(prometheus, query))]
    assert problems == [], "\n\n".join(problems)
