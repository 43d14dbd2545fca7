"""Operator reconcile latency with 50 ServingReplicas in one namespace (instances: 0, so the
measurement is the operator and the API server, not 50 model processes on a laptop)."""

from __future__ import annotations

import json
import time

import pytest

from operator_env import get_replica, operator_metric, servingreplica, timed

pytestmark = pytest.mark.e2e

REPLICAS = 50


def histogram_quantile(buckets: list[tuple[float, float]], quantile: float) -> float:
    """Upper bound of the bucket holding ``quantile`` of the observations."""
    total = buckets[-1][1]
    for bound, count in buckets:
        if count >= quantile * total:
            return bound
    return float("inf")


def test_reconcile_latency_at_fifty_replicas(dev_cluster, sr_namespace, tiny_model_dir,
                                             operator_release):
    namespace = sr_namespace
    manifests = [servingreplica(f"m{i:02d}", namespace, tiny_model_dir, instances=0, tp=8)
                 for i in range(REPLICAS)]
    with timed(f"apply {REPLICAS} ServingReplicas -> every status Ready 0/0") as timer:
        dev_cluster.kubectl("apply", "-f", "-", input_text="\n---\n".join(
            json.dumps(m) for m in manifests))
        dev_cluster.wait_for(
            lambda: all(((get_replica(dev_cluster, namespace, m["metadata"]["name"]) or {})
                         .get("status") or {}).get("phase") == "Ready" for m in manifests),
            300, f"{REPLICAS} replicas reconciled", period_s=1.0)
    assert timer.elapsed_s < 300

    # A spec change on every replica: time until each status observed the new generation.
    with timed(f"scale {REPLICAS} replicas' generation -> observedGeneration") as update:
        for manifest in manifests:
            manifest["spec"]["scheduler"] = {"targetBatchTimeMs": 40}
        dev_cluster.kubectl("apply", "-f", "-", input_text="\n---\n".join(
            json.dumps(m) for m in manifests))
        dev_cluster.wait_for(
            lambda: all((r := get_replica(dev_cluster, namespace, m["metadata"]["name"]))
                        and r["status"].get("observedGeneration") == r["metadata"]["generation"]
                        for m in manifests), 300, "every replica's new generation observed",
            period_s=1.0)
    time.sleep(2)
    buckets = sorted((float(labels["le"]), value) for labels, value in operator_metric(
        dev_cluster, operator_release, "slipstream_operator_reconcile_duration_seconds_bucket"))
    p50, p99 = histogram_quantile(buckets, 0.5), histogram_quantile(buckets, 0.99)
    print(f"[measure] reconcile duration with {REPLICAS} replicas: p50 <= {p50} s, "
          f"p99 <= {p99} s over {buckets[-1][1]:.0f} reconciles; apply->all Ready "
          f"{timer.elapsed_s:.1f} s; update->all observed {update.elapsed_s:.1f} s")
    assert p50 <= 1.0
