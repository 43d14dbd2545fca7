"""The built-in autoscaler on the real control plane: load from the openai client scales a
ServingReplica from minInstances up; when it stops, the count returns to minInstances after
the scale-down window, through a drain, with no request failing; the Events and the status
say what happened. A real Prometheus scrapes the operator throughout, and every panel of the
pools dashboard's autoscaling row (desired and current instances, decisions by reason,
drains) returns data, with the scale-up and the drain in it.

    ServingReplica (autoscaling 1..3, period 2 s, scale-down window 20 s)
    closed-loop openai clients --> "the Service" --> agents
      TTFT objective the CPU tiny model misses under load --> ScaleUp Events, new instances
    load stops; a slow trickle keeps going --> ScaleDown, the instance drains
      (its controller pod leaves the Service's selection) --> InstanceDrained, back to 1
    prometheus <--scrape-- operator :8080 --> the autoscaling panels' queries

Services get no endpoints here (loopback pod IPs; e2e/README.md), so the client does what
kube-proxy does with the client Service: it reads the Service's selector and sends each
request to a Ready pod matching it, chosen afresh per request. A draining instance's
controller pod stops matching the moment the autoscaler relabels it.
"""

from __future__ import annotations

import sys
import time

import openai
import pytest

from operator_env import (
    AUTOSCALING_SERIES, ClosedLoopLoad, OPERATOR_METRICS_PORT, POOL_LABEL, REPO, events, get_replica, is_ready,
    operator_pods, pod_ip, prometheus_scraping, replica_pods, servingreplica)

sys.path.insert(0, str(REPO / "charts"))
from dashgen import inventory, live_prometheus  # noqa: E402  (dashgen lives beside the chart)

pytestmark = pytest.mark.e2e

NAME = "elastic"
SCALE_UP_TIMEOUT_S = 240.0  # load starts -> a second instance Ready (CPU agents start slowly)
SCALE_DOWN_TIMEOUT_S = 240.0  # load stops -> back to minInstances
DOWN_WINDOW_S = 20
AUTOSCALING_QUERIES = [query for query in inventory.dashboard_queries()
                       if AUTOSCALING_SERIES.search(query.promql)]


def service_selector(dev_cluster, namespace: str, service: str) -> dict[str, str] | None:
    found = dev_cluster.api.get(f"/api/v1/namespaces/{namespace}/services/{service}",
                                ok_missing=True)
    return found["spec"]["selector"] if found else None


def service_backends(dev_cluster, namespace: str, service: str = NAME) -> list[dict]:
    """Ready pods a Service (the client Service by default) selects: what its EndpointSlice
    would list."""
    selector = service_selector(dev_cluster, namespace, service)
    if not selector:
        return []
    query = ",".join(f"{k}={v}" for k, v in selector.items())
    pods = dev_cluster.api.get(f"/api/v1/namespaces/{namespace}/pods",
                               query={"labelSelector": query})["items"]
    return [p for p in pods if is_ready(p) and not p["metadata"].get("deletionTimestamp")]


class Load(ClosedLoopLoad):
    """Clients sending completions through the "Service" (a Ready pod its selector picks, in
    turn); a failure names the pod that failed."""

    def __init__(self, dev_cluster, namespace: str, clients: int, pause_s: float,
                 service: str = NAME) -> None:
        self.dev_cluster, self.namespace, self.service = dev_cluster, namespace, service
        super().__init__(clients, self._one, pause_s)

    def _one(self, k: int, turn: int) -> object:
        backends = service_backends(self.dev_cluster, self.namespace, self.service)
        while not backends and not self.stop.is_set():
            self.stop.wait(0.2)
            backends = service_backends(self.dev_cluster, self.namespace, self.service)
        if not backends:
            return self.NOTHING_SENT
        pod = backends[(k + turn) % len(backends)]
        client = openai.OpenAI(base_url=f"http://{pod_ip(pod)}:8000/v1", api_key="unused",
                               max_retries=0, timeout=120)
        try:
            answer = client.completions.create(model="tiny", prompt="scale me " * 30,
                                               max_tokens=8)
        except Exception as error:
            raise RuntimeError(f"{pod['metadata']['name']}: {error!r}") from error
        assert answer.choices[0].finish_reason in ("length", "stop"), answer
        return pod["metadata"]["labels"]["slipstream.dev/instance"]


def autoscaling_status(dev_cluster, namespace: str, name: str = NAME) -> dict:
    replica = get_replica(dev_cluster, namespace, name) or {}
    return (replica.get("status") or {}).get("autoscaling") or {}


def live_instances(dev_cluster, namespace: str, name: str = NAME) -> set[str]:
    return {p["metadata"]["labels"]["slipstream.dev/instance"]
            for p in replica_pods(dev_cluster, namespace, name)}


def instance_pools(dev_cluster, namespace: str, name: str) -> dict[str, str]:
    """instance -> pool label, of the instances not being deleted (draining ones included)."""
    return {p["metadata"]["labels"]["slipstream.dev/instance"]:
            p["metadata"]["labels"].get(POOL_LABEL, "")
            for p in replica_pods(dev_cluster, namespace, name)}


def scaling_state(dev_cluster, namespace: str, name: str, load: ClosedLoopLoad) -> str:
    """What a timed-out scaling wait prints: the autoscaler's status, each instance's pool and
    readiness, the replica's Events and the load's counts."""
    pods = [f"{p['metadata']['name']} pool={p['metadata']['labels'].get(POOL_LABEL, '')} "
            f"ready={is_ready(p)}" for p in replica_pods(dev_cluster, namespace, name)]
    items = dev_cluster.api.get(f"/api/v1/namespaces/{namespace}/events")["items"]
    recent = [f"{e.get('reason')}: {e.get('message')}" for e in items
              if e.get("involvedObject", {}).get("kind") == "ServingReplica"][-12:]
    return (f"status.autoscaling={autoscaling_status(dev_cluster, namespace, name)}; "
            f"pods={pods}; events={recent}; load ok={load.ok} "
            f"failures={load.failures[:3]} served_by={sorted(load.served_by)}")


def operator_targets(dev_cluster, operator_release) -> list[str]:
    return [f"{pod_ip(pod)}:{OPERATOR_METRICS_PORT}"
            for pod in operator_pods(dev_cluster, operator_release, ready=True)]


def test_load_scales_up_and_back_down_through_a_drain_without_failures(
        dev_cluster, operator_release, sr_namespace, tiny_model_dir, tmp_path):
    namespace = sr_namespace
    targets = {"slipstream-operator": operator_targets(dev_cluster, operator_release)}
    with prometheus_scraping(tmp_path / "prometheus", targets) as prometheus:
        scale_up_and_down(dev_cluster, namespace, tiny_model_dir)
        autoscaling_panels_have_data(prometheus, f"{namespace}/{NAME}")


def autoscaling_panels_have_data(prometheus, replica: str) -> None:
    """Every query of the dashboard's autoscaling row shows data, and the series say what
    the test did: the replica went above 1 and is back at 1, scaled up and down, drained."""
    assert len(AUTOSCALING_QUERIES) >= 5, [q.source for q in AUTOSCALING_QUERIES]
    selector = f'replica="{replica}"'
    # Conditions, not sleeps: the last scrapes after the drain may still be on their way.
    assert prometheus.wait_for(f"slipstream_operator_desired_instances{{{selector}}} == 1")
    assert prometheus.wait_for(f"slipstream_operator_current_instances{{{selector}}} == 1")
    assert prometheus.wait_for(
        f"max_over_time(slipstream_operator_desired_instances{{{selector}}}[15m]) >= 2"), \
        "Prometheus never saw the scale-up"
    assert prometheus.wait_for(f"slipstream_operator_max_instances{{{selector}}} == 3")
    for reason in ("ScaleUp", "ScaleDown"):
        assert prometheus.wait_for(
            f'slipstream_operator_scale_decisions_total{{{selector},reason="{reason}"}} > 0'), \
            reason
    assert prometheus.wait_for('slipstream_operator_drains_total{outcome="finished"} > 0')
    problems = []
    for query in AUTOSCALING_QUERIES:
        # increase() needs two samples of a series inside its range: wait for them.
        prometheus.wait_for(query.promql)
        if problem := live_prometheus.missing_data(prometheus, query):
            problems.append(problem)
    assert problems == [], "\n\n".join(problems)
    print(f"[measure] autoscaling panels with data: "
          f"{[q.source.split(' / ')[1] for q in AUTOSCALING_QUERIES]}")


def scale_up_and_down(dev_cluster, namespace: str, tiny_model_dir) -> None:
    dev_cluster.apply(servingreplica(
        NAME, namespace, tiny_model_dir, instances=1,
        # A TTFT objective the CPU tiny model misses under load: attainment is the signal.
        slo={"ttftSeconds": 0.005},
        drainTimeoutSeconds=60,
        autoscaling={"minInstances": 1, "maxInstances": 3, "periodSeconds": 2,
                     "scaleUpStabilizationSeconds": 0,
                     "scaleDownStabilizationSeconds": DOWN_WINDOW_S, "maxStep": 1}))
    dev_cluster.wait_for(lambda: len(service_backends(dev_cluster, namespace)) == 1
                         and autoscaling_status(dev_cluster, namespace).get(
                             "desiredInstances") == 1, 240.0, "one instance serving")

    # 1. Load rises: instances go from 1 to more.
    started = time.monotonic()
    with Load(dev_cluster, namespace, clients=4, pause_s=0.0) as heavy:
        dev_cluster.wait_for(lambda: len(service_backends(dev_cluster, namespace)) >= 2,
                             SCALE_UP_TIMEOUT_S, "a second instance serving under load",
                             describe=lambda: scaling_state(dev_cluster, namespace, NAME, heavy))
        scaled_up_s = time.monotonic() - started
        # Let the new instance take requests through the Service.
        dev_cluster.wait_for(lambda: len(heavy.served_by) >= 2, 60.0,
                             "requests served by two instances")
    print(f"[measure] load start -> second instance serving: {scaled_up_s:.1f} s")
    assert heavy.failures == [], heavy.failures[:5]
    peak = len(live_instances(dev_cluster, namespace))
    assert peak >= 2
    ups = events(dev_cluster, namespace, "ScaleUp")
    assert ups and all("TTFT attainment" in e["message"] or "queue delay" in e["message"]
                       or "prefill load" in e["message"] for e in ups), ups

    # 2.-3. The load stops (a trickle goes on, too thin to be a signal); the count returns
    # to 1 after the scale-down window, through drains, and not one request fails.
    stopped = time.monotonic()
    # One request every 2 s: fewer first tokens per 30 s window than attainment needs (20).
    with Load(dev_cluster, namespace, clients=1, pause_s=2.0) as trickle:
        dev_cluster.wait_for(lambda: len(live_instances(dev_cluster, namespace)) == 1
                             and autoscaling_status(dev_cluster, namespace).get(
                                 "desiredInstances") == 1,
                             SCALE_DOWN_TIMEOUT_S, "back to minInstances",
                             describe=lambda: scaling_state(dev_cluster, namespace, NAME,
                                                            trickle))
        scaled_down_s = time.monotonic() - stopped
        # Requests after the last drain still succeed: wait for a few more answers.
        answered = trickle.ok
        dev_cluster.wait_for(lambda: trickle.ok >= answered + 2, 60.0,
                             "requests answered after the drain")
    print(f"[measure] load stop -> back to 1 instance: {scaled_down_s:.1f} s "
          f"({trickle.ok} requests during the scale-down)")
    assert trickle.failures == [], trickle.failures[:5]
    assert trickle.ok > 0
    assert scaled_down_s >= DOWN_WINDOW_S

    # 4. The Events and the status tell the story.
    downs = events(dev_cluster, namespace, "ScaleDown")
    drained = events(dev_cluster, namespace, "InstanceDrained")
    for event in ups + downs + drained:
        print(f"[event] {event['reason']}: {event['message']}")
    print(f"[measure] peak {peak} instances; status.autoscaling "
          f"{autoscaling_status(dev_cluster, namespace)}")
    assert downs, "no ScaleDown event"
    assert len(drained) >= peak - 1, [e["message"] for e in drained]
    assert not events(dev_cluster, namespace, "DrainTimedOut")
    status = autoscaling_status(dev_cluster, namespace)
    assert status["desiredInstances"] == 1 and status["currentInstances"] >= 1
    assert status["lastScaleReason"] in ("ScaleDown", "AtMinInstances", "WithinTargets")
    assert status.get("lastScaleTime")
    replica = get_replica(dev_cluster, namespace, NAME)
    assert replica["status"]["ready"] == "1/1"


POOLED = "elastic-pools"


def test_with_pools_scale_up_feeds_the_pressured_pool_and_the_drain_keeps_min_per_pool(
        dev_cluster, sr_namespace, tiny_model_dir):
    """Autoscaling and pools together: load on the short pool's Service adds an instance to
    the short pool (the pressured one); when the load stops the count returns to
    minInstances through a drain of a short instance, because the long pool is at minPerPool;
    no request fails and the rebalancer does not move anything while the count changes."""
    namespace = sr_namespace
    short_service = f"{POOLED}-short"
    dev_cluster.apply(servingreplica(
        POOLED, namespace, tiny_model_dir, instances=2,
        pools={"short": 1, "longPrefillThresholdTokens": 8192,
               "rebalance": {"enabled": True, "periodSeconds": 2, "cooldownSeconds": 15,
                             "hysteresis": 0.2, "minPerPool": 1}},
        slo={"ttftSeconds": 0.005},
        drainTimeoutSeconds=60,
        autoscaling={"minInstances": 2, "maxInstances": 3, "periodSeconds": 2,
                     "scaleUpStabilizationSeconds": 0,
                     "scaleDownStabilizationSeconds": DOWN_WINDOW_S, "maxStep": 1}))
    dev_cluster.wait_for(
        lambda: sorted(instance_pools(dev_cluster, namespace, POOLED).values())
        == ["long", "short"] and len(service_backends(dev_cluster, namespace, short_service))
        == 1 and autoscaling_status(dev_cluster, namespace, POOLED).get("desiredInstances")
        == 2, 240.0, "one short and one long instance serving")
    (long_instance,) = [i for i, pool in instance_pools(dev_cluster, namespace, POOLED).items()
                        if pool == "long"]

    # Up: the short pool is the pressured one, so the new instance joins it.
    with Load(dev_cluster, namespace, clients=4, pause_s=0.0, service=short_service) as heavy:
        dev_cluster.wait_for(
            lambda: len(service_backends(dev_cluster, namespace, short_service)) >= 2,
            SCALE_UP_TIMEOUT_S, "a second short-pool instance serving under load",
            describe=lambda: scaling_state(dev_cluster, namespace, POOLED, heavy))
        dev_cluster.wait_for(lambda: len(heavy.served_by) >= 2, 60.0,
                             "requests served by both short instances")
    assert heavy.failures == [], heavy.failures[:5]
    pools = instance_pools(dev_cluster, namespace, POOLED)
    assert sorted(pools.values()) == ["long", "short", "short"], pools
    assert pools[long_instance] == "long"
    ups = events(dev_cluster, namespace, "ScaleUp")
    assert ups, "no ScaleUp event"

    # Down: back to 2 through a drain; the long pool keeps its one instance (minPerPool).
    with Load(dev_cluster, namespace, clients=1, pause_s=2.0, service=short_service) as trickle:
        dev_cluster.wait_for(
            lambda: len(live_instances(dev_cluster, namespace, POOLED)) == 2
            and autoscaling_status(dev_cluster, namespace, POOLED).get("desiredInstances") == 2,
            SCALE_DOWN_TIMEOUT_S, "back to minInstances",
            describe=lambda: scaling_state(dev_cluster, namespace, POOLED, trickle))
        # Requests after the drain still succeed: wait for a few more to be answered.
        answered = trickle.ok
        dev_cluster.wait_for(lambda: trickle.ok >= answered + 2, 60.0,
                             "requests answered after the drain")
    assert trickle.failures == [], trickle.failures[:5]
    pools = instance_pools(dev_cluster, namespace, POOLED)
    assert sorted(pools.values()) == ["long", "short"], pools
    assert pools.get(long_instance) == "long", "the long pool's only instance was drained"
    drained = events(dev_cluster, namespace, "InstanceDrained")
    assert drained and not any(e["message"].startswith(f"{long_instance} removed")
                               for e in drained), drained
    # Scaling ran first: the rebalancer moved nothing (the long pool sat at minPerPool, and
    # it holds while the count changes).
    assert not events(dev_cluster, namespace, "PoolRebalanced")
    replica = get_replica(dev_cluster, namespace, POOLED)
    assert (replica["status"]["pools"]["short"], replica["status"]["pools"]["long"]) == (1, 1)
    for event in ups + drained:
        print(f"[event] {event['reason']}: {event['message']}")
