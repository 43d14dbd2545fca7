"""Operator reconcile latency with 50 ServingReplicas in one namespace (instances: 0, so the
measurement is the operator and the API server, not 50 model processes on a small machine)."""

from __future__ import annotations

import json
import statistics
import time

import pytest

from operator_env import get_replica, operator_metric, servingreplica, timed

pytestmark = pytest.mark.e2e

REPLICAS = 50
SAMPLES = 10


def list_replicas(dev_cluster, namespace: str) -> list[dict]:
    return dev_cluster.api.get(
        f"/apis/slipstream.dev/v1alpha1/namespaces/{namespace}/servingreplicas")["items"]


def all_observed(dev_cluster, namespace: str) -> bool:
    replicas = list_replicas(dev_cluster, namespace)
    return len(replicas) == REPLICAS and all(
        (r.get("status") or {}).get("observedGeneration") == r["metadata"]["generation"]
        and r["status"].get("phase") == "Ready" for r in replicas)


def histogram_quantile(buckets: list[tuple[float, float]], quantile: float) -> float:
    """Upper bound of the bucket holding ``quantile`` of the observations."""
    total = buckets[-1][1]
    return next(bound for bound, count in buckets if count >= quantile * total)


def test_reconcile_latency_at_fifty_replicas(dev_cluster, sr_namespace, tiny_model_dir,
                                             operator_release):
    namespace = sr_namespace
    manifests = [servingreplica(f"m{i:02d}", namespace, tiny_model_dir, instances=0, tp=8)
                 for i in range(REPLICAS)]
    with timed(f"apply {REPLICAS} ServingReplicas at once -> every status Ready") as burst:
        dev_cluster.kubectl("apply", "-f", "-", input_text="\n---\n".join(
            json.dumps(m) for m in manifests))
        dev_cluster.wait_for(lambda: all_observed(dev_cluster, namespace), 300,
                             f"{REPLICAS} replicas reconciled", period_s=0.5)
    buckets = sorted((float(labels["le"]), value) for labels, value in operator_metric(
        dev_cluster, operator_release, "slipstream_operator_reconcile_duration_seconds_bucket"))

    # Steady state with 50 replicas (their resync timers running): one spec change at a
    # time, timed from the API write to the status that observed it.
    latencies_s = []
    for manifest in manifests[:SAMPLES]:
        name = manifest["metadata"]["name"]
        generation = get_replica(dev_cluster, namespace, name)["metadata"]["generation"]
        started = time.monotonic()
        dev_cluster.kubectl("patch", "servingreplica", name, "-n", namespace, "--type=merge",
                            "-p", json.dumps({"spec": {"scheduler": {
                                "targetBatchTimeMs": 40 + generation}}}))
        dev_cluster.wait_for(
            lambda: (get_replica(dev_cluster, namespace, name)["status"]
                     .get("observedGeneration") == generation + 1),
            30, f"{name} observed", period_s=0.05)
        latencies_s.append(time.monotonic() - started)
    p50_s = statistics.median(latencies_s)
    print(f"[measure] {REPLICAS} replicas: burst apply -> all reconciled {burst.elapsed_s:.1f} "
          f"s (reconcile duration p50 <= {histogram_quantile(buckets, 0.5)} s, p99 <= "
          f"{histogram_quantile(buckets, 0.99)} s over {buckets[-1][1]:.0f} reconciles); "
          f"steady state spec change -> observedGeneration p50 {p50_s * 1000:.0f} ms, "
          f"max {max(latencies_s) * 1000:.0f} ms (kubectl patch included)")
    assert p50_s < 2.0
    assert burst.elapsed_s < 120
