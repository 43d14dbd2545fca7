"""Leader election through kopf peering: with two operator replicas one leads and the other
stands by; when one goes away the other serves, and nothing is duplicated either way."""

from __future__ import annotations

import pytest

from operator_env import (
    get_replica, operator_pods, replica_pods, servingreplica, wait_ready)

pytestmark = pytest.mark.e2e

PEERING = "slipstream-operator"


def peers(dev_cluster) -> dict:
    peering = dev_cluster.api.get(f"/apis/kopf.dev/v1/clusterkopfpeerings/{PEERING}")
    return peering.get("status") or {}


def leads(dev_cluster, release, pod: dict) -> bool:
    """Did this operator's last word on peering say it is running?"""
    log = dev_cluster.pod_log(release.namespace, pod["metadata"]["name"])
    events = [line for line in log.splitlines()
              if "Resuming operations" in line or "Pausing operations" in line]
    return bool(events) and "Resuming operations" in events[-1]


def scale_operator(dev_cluster, release, replicas: int) -> None:
    dev_cluster.kubectl("scale", "deployment", release.deployment, "-n", release.namespace,
                        f"--replicas={replicas}")
    dev_cluster.wait_for(lambda: len(operator_pods(dev_cluster, release, ready=True)) ==
                         replicas and len(operator_pods(dev_cluster, release)) == replicas,
                         120, f"{replicas} operator pod(s) Ready")


def test_two_operators_one_leader_and_failover(dev_cluster, operator_release, sr_namespace,
                                               tiny_model_dir):
    namespace = sr_namespace
    scale_operator(dev_cluster, operator_release, 2)
    try:
        dev_cluster.wait_for(lambda: len(peers(dev_cluster)) == 2, 60,
                             "both operators in the peering")
        priorities = sorted(info["priority"] for info in peers(dev_cluster).values())
        assert priorities[0] != priorities[1], "equal priorities would pause both"
        # kopf starts paused and says "Resuming" once it finds itself the highest priority;
        # a leader that meets a higher newcomer says "Pausing" instead.
        leaders = dev_cluster.wait_for(
            lambda: [p for p in operator_pods(dev_cluster, operator_release)
                     if leads(dev_cluster, operator_release, p)], 60, "a leading operator")
        assert len(leaders) == 1

        dev_cluster.apply(servingreplica("lead", namespace, tiny_model_dir, instances=1))
        wait_ready(dev_cluster, namespace, "lead", "1/1")
        assert len(replica_pods(dev_cluster, namespace, "lead")) == 1

        # The leader goes away: the stand-by takes over and keeps reconciling.
        dev_cluster.kubectl("delete", "pod", leaders[0]["metadata"]["name"], "-n",
                            operator_release.namespace)
        dev_cluster.kubectl("scale", "servingreplica", "lead", "-n", namespace,
                            "--replicas=2")
        wait_ready(dev_cluster, namespace, "lead", "2/2")
        assert len(replica_pods(dev_cluster, namespace, "lead")) == 2
        assert get_replica(dev_cluster, namespace, "lead")["status"]["phase"] == "Ready"
    finally:
        scale_operator(dev_cluster, operator_release, 1)
