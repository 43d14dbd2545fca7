"""(5) Deleting one pod recreates its whole instance while the other keeps serving, and an
operator restart creates no duplicate children. (6) Scaling 2 -> 3 -> 1."""

from __future__ import annotations

import threading
import time

import pytest

from operator_env import (
    complete, events, get_replica, operator_pods, replica_pods, servingreplica, wait_ready)

pytestmark = pytest.mark.e2e


def instance_of(pod: dict) -> str:
    return pod["metadata"]["labels"]["slipstream.dev/instance"]


def children(dev_cluster, namespace: str) -> dict[str, list[str]]:
    return {kind: sorted(i["metadata"]["name"] for i in
                         dev_cluster.kubectl_json("get", kind, "-n", namespace)["items"]
                         if not i["metadata"].get("deletionTimestamp"))
            for kind in ("pods", "services", "configmaps")}


class SteadyTraffic:
    """Completions against one pod in a loop; counts successes and failures."""

    def __init__(self, pod: dict) -> None:
        self.pod, self.ok, self.failures = pod, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                complete(self.pod, "keep serving", max_tokens=2)
                self.ok += 1
            except Exception as error:  # noqa: BLE001 - every failure is a finding
                self.failures.append(repr(error))

    def __enter__(self) -> SteadyTraffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def test_failed_pod_recreates_its_instance_while_the_other_serves(dev_cluster, sr_namespace,
                                                                   tiny_model_dir,
                                                                   operator_release):
    namespace = sr_namespace
    dev_cluster.apply(servingreplica("r", namespace, tiny_model_dir, instances=2))
    wait_ready(dev_cluster, namespace, "r", "2/2")
    victim, survivor = replica_pods(dev_cluster, namespace, "r")
    with SteadyTraffic(survivor) as traffic:
        dev_cluster.kubectl("delete", "pod", victim["metadata"]["name"], "-n", namespace,
                            "--wait=false")
        dev_cluster.wait_for(lambda: events(dev_cluster, namespace, "InstanceRestarted"), 60,
                             "an InstanceRestarted Event")

        def replaced() -> bool:
            names = {p["metadata"]["name"]: instance_of(p)
                     for p in replica_pods(dev_cluster, namespace, "r")}
            return victim["metadata"]["name"] not in names and \
                sorted(names.values()) == ["r-0", "r-1"]

        # The status can still read 2/2 from before the deletion; wait for the pods first.
        dev_cluster.wait_for(replaced, 60, "a replacement pod for the deleted one")
        replica = wait_ready(dev_cluster, namespace, "r", "2/2")
        time.sleep(1)
    assert traffic.failures == [] and traffic.ok > 0
    pods = replica_pods(dev_cluster, namespace, "r")
    names = {p["metadata"]["name"] for p in pods}
    assert survivor["metadata"]["name"] in names, "the healthy instance was left alone"
    assert victim["metadata"]["name"] not in names
    assert sorted(instance_of(p) for p in pods) == ["r-0", "r-1"]
    replacement = next(p for p in pods if instance_of(p) == instance_of(victim))

    def ranks_with_replacement() -> dict[str, str] | None:
        # Ready can be reported a reconcile before the ranks list names the new pod.
        status = get_replica(dev_cluster, namespace, "r")["status"]
        ranks = {rank["pod"]: rank["node"] for instance in status["instances"]
                 for rank in instance["ranks"]}
        return ranks if replacement["metadata"]["name"] in ranks else None

    ranks = dev_cluster.wait_for(ranks_with_replacement, 30, "status ranks naming the new pod")
    assert ranks[replacement["metadata"]["name"]] == replacement["spec"]["nodeName"]
    assert replica["status"]["phase"] == "Ready"

    # Restart the operator: the new process adopts what exists and creates nothing.
    before = children(dev_cluster, namespace)
    old_operator = operator_pods(dev_cluster, operator_release)[0]["metadata"]["name"]
    dev_cluster.kubectl("delete", "pod", old_operator, "-n", operator_release.namespace)
    dev_cluster.wait_for(lambda: [p for p in operator_pods(dev_cluster, operator_release,
                                                             ready=True)
                                  if p["metadata"]["name"] != old_operator], 90,
                         "a new operator pod Ready")
    dev_cluster.kubectl("annotate", "servingreplica", "r", "-n", namespace, "touch=1")
    time.sleep(20)  # resume handlers, a resync timer tick and the annotation update
    assert children(dev_cluster, namespace) == before
    assert get_replica(dev_cluster, namespace, "r")["status"]["ready"] == "2/2"


def test_scaling_two_three_one(dev_cluster, sr_namespace, tiny_model_dir):
    namespace = sr_namespace
    dev_cluster.apply(servingreplica("s", namespace, tiny_model_dir, instances=2, tp=2))
    wait_ready(dev_cluster, namespace, "s", "2/2")
    dev_cluster.kubectl("scale", "servingreplica", "s", "-n", namespace, "--replicas=3")
    replica = wait_ready(dev_cluster, namespace, "s", "3/3")
    assert [i["name"] for i in replica["status"]["instances"]] == ["s-0", "s-1", "s-2"]
    assert len(replica_pods(dev_cluster, namespace, "s")) == 3
    gpus = sum(int(p["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"])
               for p in replica_pods(dev_cluster, namespace, "s"))
    assert gpus == 6
    scale = dev_cluster.api.get(f"/apis/slipstream.dev/v1alpha1/namespaces/{namespace}/"
                                "servingreplicas/s/scale")
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == "slipstream.dev/replica=s"
    dev_cluster.kubectl("scale", "servingreplica", "s", "-n", namespace, "--replicas=1")
    replica = wait_ready(dev_cluster, namespace, "s", "1/1")
    assert [i["name"] for i in replica["status"]["instances"]] == ["s-0"]
    dev_cluster.wait_for(lambda: len(replica_pods(dev_cluster, namespace, "s",
                                                  live=False)) == 1, 60,
                         "the scaled-down pods gone")
    assert complete(replica_pods(dev_cluster, namespace, "s")[0])
