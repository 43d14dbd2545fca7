"""The built-in autoscaler on the real control plane: load from the openai client scales a
ServingReplica from minInstances up; when it stops, the count returns to minInstances after
the scale-down window, through a drain, with no request failing; the Events and the status
say what happened.

    ServingReplica (autoscaling 1..3, period 2 s, scale-down window 20 s)
    closed-loop openai clients --> "the Service" --> agents
      TTFT objective the CPU tiny model misses under load --> ScaleUp Events, new instances
    load stops; a slow trickle keeps going --> ScaleDown, the instance drains
      (its controller pod leaves the Service's selection) --> InstanceDrained, back to 1

Services get no endpoints here (loopback pod IPs; e2e/README.md), so the client does what
kube-proxy does with the client Service: it reads the Service's selector and sends each
request to a Ready pod matching it, chosen afresh per request. A draining instance's
controller pod stops matching the moment the autoscaler relabels it.
"""

from __future__ import annotations

import itertools
import threading
import time

import openai
import pytest

from operator_env import events, get_replica, is_ready, pod_ip, replica_pods, servingreplica

pytestmark = pytest.mark.e2e

NAME = "elastic"
SCALE_UP_TIMEOUT_S = 240.0  # load starts -> a second instance Ready (CPU agents start slowly)
SCALE_DOWN_TIMEOUT_S = 240.0  # load stops -> back to minInstances
DOWN_WINDOW_S = 20


def service_selector(dev_cluster, namespace: str) -> dict[str, str] | None:
    service = dev_cluster.api.get(f"/api/v1/namespaces/{namespace}/services/{NAME}",
                                  ok_missing=True)
    return service["spec"]["selector"] if service else None


def service_backends(dev_cluster, namespace: str) -> list[dict]:
    """Ready pods the client Service selects (what its EndpointSlice would list)."""
    selector = service_selector(dev_cluster, namespace)
    if not selector:
        return []
    query = ",".join(f"{k}={v}" for k, v in selector.items())
    pods = dev_cluster.api.get(f"/api/v1/namespaces/{namespace}/pods",
                               query={"labelSelector": query})["items"]
    return [p for p in pods if is_ready(p) and not p["metadata"].get("deletionTimestamp")]


class Load:
    """Clients sending completions through the "Service"; counts successes and failures."""

    def __init__(self, dev_cluster, namespace: str, clients: int, pause_s: float) -> None:
        self.dev_cluster, self.namespace, self.pause_s = dev_cluster, namespace, pause_s
        self.stop = threading.Event()
        self.ok, self.failures, self.served_by = 0, [], set()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                        for k in range(clients)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _run(self, k: int) -> None:
        turn = itertools.count(k)
        while not self.stop.is_set():
            backends = service_backends(self.dev_cluster, self.namespace)
            if not backends:
                time.sleep(0.2)
                continue
            pod = backends[next(turn) % len(backends)]
            client = openai.OpenAI(base_url=f"http://{pod_ip(pod)}:8000/v1", api_key="unused",
                                   max_retries=0, timeout=120)
            try:
                answer = client.completions.create(model="tiny", prompt="scale me " * 30,
                                                   max_tokens=8)
                assert answer.choices[0].finish_reason in ("length", "stop")
                with self.lock:
                    self.ok += 1
                    self.served_by.add(pod["metadata"]["labels"]["slipstream.dev/instance"])
            except Exception as error:  # noqa: BLE001 - recorded, asserted on
                with self.lock:
                    self.failures.append(f"{pod['metadata']['name']}: {error!r}")
            self.stop.wait(self.pause_s)


def autoscaling_status(dev_cluster, namespace: str) -> dict:
    replica = get_replica(dev_cluster, namespace, NAME) or {}
    return (replica.get("status") or {}).get("autoscaling") or {}


def live_instances(dev_cluster, namespace: str) -> set[str]:
    return {p["metadata"]["labels"]["slipstream.dev/instance"]
            for p in replica_pods(dev_cluster, namespace, NAME)}


def test_load_scales_up_and_back_down_through_a_drain_without_failures(
        dev_cluster, sr_namespace, tiny_model_dir):
    namespace = sr_namespace
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
                             SCALE_UP_TIMEOUT_S, "a second instance serving under load")
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
                             SCALE_DOWN_TIMEOUT_S, "back to minInstances")
        scaled_down_s = time.monotonic() - stopped
        time.sleep(3)  # requests after the last drain still succeed
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
