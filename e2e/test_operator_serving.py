"""(2) A ServingReplica of 2 instances of 8 GPUs (tp 2 x spp 2 x kvp 2) on the 2 fake 8-GPU
nodes: placed one per node, bound by kube-scheduler, agents Ready with all 8 worker ranks
each, status and printer columns right, completions served.
(8) Deleting it removes every child by garbage collection."""

from __future__ import annotations

import pytest

from operator_env import (
    complete, get_replica, replica_pods, servingreplica, timed, wait_ready)

pytestmark = pytest.mark.e2e


def owned_children(dev_cluster, namespace: str, uid: str) -> list[str]:
    found = []
    for kind in ("pods", "services", "configmaps"):
        for item in dev_cluster.kubectl_json("get", kind, "-n", namespace)["items"]:
            owners = item["metadata"].get("ownerReferences") or []
            if any(owner["uid"] == uid for owner in owners):
                found.append(f"{kind}/{item['metadata']['name']}")
    return found


def test_two_instances_on_two_nodes_serve_and_are_collected(dev_cluster, sr_namespace,
                                                             tiny_model_dir):
    namespace = sr_namespace
    with timed("kubectl apply -> Ready, 2 instances of 8 ranks on 2 nodes") as timer:
        dev_cluster.apply(servingreplica("chat", namespace, tiny_model_dir, instances=2,
                                         parallelism={"tp": 2, "spp": 2, "kvp": 2}))
        replica = wait_ready(dev_cluster, namespace, "chat", "2/2")
    assert timer.elapsed_s < 180

    status = replica["status"]
    pods = replica_pods(dev_cluster, namespace, "chat")
    assert len(pods) == 2
    # One instance per node: the placement pinned each pod, kube-scheduler bound it there.
    nodes = sorted(p["spec"]["nodeName"] for p in pods)
    assert nodes == sorted(dev_cluster.nodes)
    for pod in pods:
        pinned = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
            "matchFields"][0]["values"]
        assert pinned == [pod["spec"]["nodeName"]]
        assert pod["status"]["phase"] == "Running"
    by_pod = {rank["pod"]: rank["node"] for instance in status["instances"]
              for rank in instance["ranks"]}
    assert by_pod == {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods}
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Placed": "True", "Ready": "True", "Degraded": "False"}
    assert status["observedGeneration"] == replica["metadata"]["generation"]
    assert status["endpoint"] == f"http://chat.{namespace}.svc:8000/v1"

    table = dev_cluster.kubectl("get", "servingreplicas", "chat", "-n", namespace).stdout
    header, row = table.strip().splitlines()
    assert header.split()[:4] == ["NAME", "READY", "SHORT", "LONG"] and "PHASE" in header
    assert row.split()[:2] == ["chat", "2/2"] and "Ready" in row.split()

    for pod in pods:  # the official openai client against each instance's endpoint
        assert isinstance(complete(pod, "Once upon a time"), str)

    uid = replica["metadata"]["uid"]
    assert len(owned_children(dev_cluster, namespace, uid)) == 2 + 2 + 1 + 1  # pods,
    # headless services, the client service and the engine ConfigMap
    dev_cluster.kubectl("delete", "servingreplica", "chat", "-n", namespace, "--wait=false")
    dev_cluster.wait_for(lambda: get_replica(dev_cluster, namespace, "chat") is None, 60,
                         "the ServingReplica gone")
    dev_cluster.wait_for(lambda: not owned_children(dev_cluster, namespace, uid)
                         and not replica_pods(dev_cluster, namespace, "chat", live=False),
                         90, "garbage collection of every child")
